"""What schedule() hands the executor and what update() hands the service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from protos.contract import BlockMap
from scheduler_service.core.logprobs import PromptChunk, TokenLogprob
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.window_groups import WindowBlocks


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: list[int]
    sampling: SamplingOptions


@dataclass(slots=True)
class RunningRequestData:
    request_id: str
    new_block_ids: list[int]
    num_scheduled_tokens: int
    resumed: bool = False
    draft_token_ids: tuple[int, ...] = ()
    num_model_drafts: int = 0


@dataclass(slots=True)
class ScheduledWork:
    """One request's part of a step. Read-only to consumers: the scheduler hands out the same object
    (and its empty new_block_ids) for a request's plain decodes step after step. draft_token_ids: proposed
    tokens the executor verifies after the request's last token (speculative decoding; their slots are in
    new_block_ids' tables, and they are charged to the token budget beside num_tokens). num_model_drafts: as
    many tokens the executor's draft model proposes there instead (method draft_model)."""

    request: Request
    num_tokens: int
    new_block_ids: list[int]
    is_new: bool = False
    resumed: bool = False
    draft_token_ids: tuple[int, ...] = ()
    num_model_drafts: int = 0

    @property
    def num_drafts(self) -> int:
        """Draft tokens verified after the request's last token: given, or proposed by the draft model."""
        return len(self.draft_token_ids) + self.num_model_drafts


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None
    """Once per request that asked: its prompt positions 1 .. P-1 (core/prompt_logprobs.py)."""


@dataclass(slots=True)
class PlainRows:
    """The step's plain decodes (one token, no new blocks, nothing else to tell the executor), which lead
    out.scheduled: their RunningSet slots and slot generations, ids, output lists and requests."""

    slots: np.ndarray
    gens: np.ndarray
    ids: list[str]
    outputs: list[list[int]]
    requests: list[Request]
    works: list[ScheduledWork]


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledWork] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    swapped_out_ids: list[str] = field(default_factory=list)
    swap_out: BlockMap = field(default_factory=list)
    swap_in: BlockMap = field(default_factory=list)
    copy: BlockMap = field(default_factory=list)
    num_steps: int = 1
    num_lookahead_slots: int = 0
    rejected: list[RequestDelta] = field(default_factory=list)
    num_preempted: int = 0
    plain: PlainRows | None = None
    window: dict[str, WindowBlocks] = field(default_factory=dict)  # hybrid models: see Scheduler._window_news

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(w.num_tokens + w.num_drafts for w in self.scheduled)

    @property
    def needs_executor(self) -> bool:
        return bool(self.scheduled or self.finished_ids or self.swap_out or self.swap_in or self.copy)

    def explicit_works(self) -> list[ScheduledWork]:
        """The works after the plain decodes that lead `scheduled`."""
        return self.scheduled[len(self.plain.ids):] if self.plain is not None else self.scheduled

    def new_requests(self) -> list[NewRequestData]:
        return [
            NewRequestData(w.request.request_id, w.request.all_token_ids, w.request.num_prompt_tokens,
                           w.request.num_computed_tokens, w.num_tokens, w.new_block_ids, w.request.sampling)
            for w in self.scheduled if w.is_new
        ]

    def running_requests(self) -> list[RunningRequestData]:
        return [
            RunningRequestData(w.request.request_id, w.new_block_ids, w.num_tokens, w.resumed, w.draft_token_ids,
                               w.num_model_drafts)
            for w in self.scheduled if not w.is_new
        ]


@dataclass(slots=True)
class ExecutorResult:
    """What a step sampled: one token each for `ids` (aligned with `tokens`, often in the step's order),
    and the token lists of `sampled` (requests that sampled several, or a result built by hand)."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptChunk] = field(default_factory=dict)
    ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    busy_s: float = 0.0  # the executor's own time in the step (StepResult.timings), 0 where not reported
    _index: dict[str, int] | None = field(default=None, init=False, repr=False)

    def tokens_of(self, request_id: str) -> list[int] | None:
        found = self.sampled.get(request_id)
        if found is not None or not self.ids:
            return found
        token = self.token_index().get(request_id)
        return None if token is None else [token]

    def token_index(self) -> dict[str, int]:
        if self._index is None:
            self._index = dict(zip(self.ids, self.tokens, strict=True))
        return self._index


@dataclass(slots=True)
class StepDeltas:
    """update()'s answer: one new token for each of ids (aligned with tokens, nothing else to say),
    then `others` (finishes, errors, several tokens, logprobs). Iterating gives RequestDelta objects."""

    others: list[RequestDelta] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def __iter__(self) -> Iterator[RequestDelta]:
        yield from self.others
        for rid, token in zip(self.ids, self.tokens, strict=True):
            yield RequestDelta(rid, [token])

    def __len__(self) -> int:
        return len(self.others) + len(self.ids)

    def __getitem__(self, i: int) -> RequestDelta:
        return list(self)[i]
