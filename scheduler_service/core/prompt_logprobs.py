"""A request's prompt logprobs (SamplingParams.prompt_logprobs) on their way from the executor to the client.

The executor answers them chunk by chunk as it computes the prompt (StepResult.prompt_logprobs: a first position
and the entries after it). The record keeps them in position order and hands them over once, complete, in the
delta of the step that completed them. A recompute (preemption, executor loss) computes the prompt again from
position 0: entries before the next missing position are dropped, so none is delivered twice; after delivery the
request no longer asks (executor_link sends it without prompt_logprobs) and may use the prefix cache again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_service.core.logprobs import PromptChunk, TokenLogprob


@dataclass(slots=True)
class PromptLogprobsRecord:
    """Positions 1 .. num_positions of a prompt: collected in order until complete, then delivered once."""

    num_positions: int
    collected: list[TokenLogprob] = field(default_factory=list)
    delivered: bool = False

    def add(self, chunk: PromptChunk) -> str:
        """Append a chunk's entries past the ones already held; an error when it leaves a gap."""
        first, entries = chunk
        expected = 1 + len(self.collected)
        if first > expected:
            return f"the executor's prompt logprobs skipped prompt positions {expected} to {first - 1}"
        room = self.num_positions - len(self.collected)
        skip = expected - first
        self.collected += entries[skip:skip + room]
        return ""

    @property
    def complete(self) -> bool:
        return len(self.collected) == self.num_positions

    def deliver(self) -> list[TokenLogprob]:
        out, self.collected, self.delivered = self.collected, [], True
        return out


    def collect(self, chunk: PromptChunk | None, prompt_computed: bool) -> tuple[str, list[TokenLogprob] | None]:
        """After a step computed part of its request's prompt (all of it: prompt_computed): (error, the complete
        list if it is complete now). An executor that computed the whole prompt without answering every position
        is an error."""
        if self.delivered:
            return "", None
        error = self.add(chunk) if chunk is not None else ""
        if error:
            return error, None
        if self.complete:
            return "", self.deliver()
        if prompt_computed:
            return (f"the executor answered prompt logprobs for {len(self.collected)} of the prompt's "
                    f"{self.num_positions} positions"), None
        return "", None
