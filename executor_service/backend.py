"""What an executor backend (simulated or torch) implements, below the gRPC shell."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from protos.contract import BlockMap, SamplingConfig, prompt_logprob_positions

__all__ = ["Backend", "BackendInfo", "BackendLost", "BatchItem", "BlockMap", "PromptLogprobs", "SampleOutput",
           "SamplingConfig", "attended_keys", "prompt_logprob_positions"]


class BackendLost(RuntimeError):
    """The backend can run no more steps (a tensor-parallel peer or collective failed): the executor ends
    its stream instead of answering, and the process is going down (fail-stop)."""


def attended_keys(start: int, num_tokens: int) -> int:
    """Keys the causal queries at positions [start, start + num_tokens) attend to: position p sees p + 1."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(slots=True)
class BatchItem:
    """One request's work in one forward pass.

    token_ids holds every known token (prompt, then outputs). Positions [0, start) are
    already in the KV cache; this pass computes positions [start, start + num_tokens),
    whose input tokens are token_ids[start:start + num_tokens]. The KV slot of position p
    is block_table[p // block_size] * block_size + p % block_size. When sample is True
    (start + num_tokens == len(token_ids)) the backend samples the token that follows, among those token_mask allows.
    draft_token_ids (speculative decoding, only on an item that samples): proposed tokens after the last one;
    the pass also computes their positions (their slots are in block_table) and verifies them: its sample is
    the accepted drafts and then the model's own next token (SampleOutput.extra).
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    start: int
    num_tokens: int
    block_table: list[int]
    sample: bool
    sampling: SamplingConfig
    draft_token_ids: Sequence[int] = ()
    num_model_drafts: int = 0
    """Speculative decoding with the backend's draft model: it proposes this many tokens after the last one (greedy,
    into the lookahead slots of block_table) and verifies them as draft_token_ids; not with draft_token_ids."""
    draft_start: int = 0
    """The draft model's KV holds positions [0, draft_start) of this request (<= start): its pass catches up."""
    token_mask: np.ndarray | None = None
    """Structured outputs: the tokens it may sample here (token_masks.py's row: bit t of the bytes, least
    significant bit first, allows token t); None = any. An item with a mask carries no drafts."""
    deferred_masks: DeferredRows | None = None
    """Masks that follow the step: a backend that overlaps them (Backend.overlaps_token_masks) waits for them after
    the forward pass, before sampling, on its forward thread (token_masks.resolve_masks)."""
    window_tables: Sequence[list[int]] = ()
    """KV cache groups (BackendInfo.kv_window_groups): each window group's table by position like block_table, 0 in
    the positions before the window, whose blocks were released and are never read (rings: block i is
    ring[i % R], so the table repeats the ring)."""
    prompt_out: PromptLogprobs | None = None
    """The backend's answer for an item whose sampling asks prompt_logprobs: the logprobs of the prompt positions
    this pass yields (prompt_logprob_positions), set by execute(); None where it yields none."""

    def prompt_positions(self) -> range:
        """The prompt positions whose logprobs this pass must answer (empty unless the request asks for them)."""
        if self.sampling.prompt_logprobs is None:
            return range(0)
        return prompt_logprob_positions(self.start, self.num_tokens, self.num_prompt_tokens)


class DeferredRows(Protocol):
    def wait(self) -> dict[str, np.ndarray]: ...


@dataclass(slots=True)
class SampleOutput:
    """A sampled token; after a verification of drafts, extra holds the tokens that follow it in the same pass
    (token_id was the first draft, accepted; the last of extra is the model's own token)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    extra: list[SampleOutput] = field(default_factory=list)

    def run(self) -> list[SampleOutput]:
        """This token and the ones after it from verified drafts."""
        return [self, *self.extra] if self.extra else [self]


@dataclass(slots=True)
class PromptLogprobs:
    """Logprobs of consecutive prompt positions: tokens[i] is position first_position + i's token, its logprob
    given the tokens before it and the top alternatives there."""

    first_position: int
    tokens: list[SampleOutput]


@dataclass(slots=True, frozen=True)
class BackendInfo:
    model_id: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    block_size: int
    num_device_blocks: int
    num_swap_blocks: int
    dtype: str
    device: str
    max_logprobs: int = 20
    tokenizer_json: str = ""
    bos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str = ""
    startup_seconds: float = 0.0
    """From the process's start to ready (set when it starts serving)."""
    startup_phases: tuple[tuple[str, float], ...] = ()
    """Seconds of each start-up phase, in order."""
    max_num_draft_tokens: int = 0
    """Draft tokens it verifies per request and pass (speculative decoding); 0: it does not verify drafts."""
    max_num_model_draft_tokens: int = 0
    """Tokens its draft model proposes per request and pass (BatchItem.num_model_drafts); 0: no draft model."""
    architecture: str = ""
    """The Hugging Face architecture name served ("" for none, e.g. the simulated backend)."""
    sliding_windows: tuple[int, ...] = ()
    """Per layer: the sliding window (keys a query sees), 0 for full attention; () for none."""
    kv_window_groups: int = 0
    """Sliding-window KV cache groups it keeps a table each for (Capabilities.kv_window_groups); 0: one table."""
    kv_window: int = 0
    """The most keys a query of those groups reads (Capabilities.kv_window)."""
    kv_window_ring: bool = False
    """Its window tables are rings (Capabilities.kv_window_ring): BatchItem.window_tables come expanded by
    position from the rings, and a window layer reads its step's own keys fresh, writing them into the ring after
    its queries read it (only the step's last kv_window positions)."""
    kv_window_only: bool = False
    """Every layer slides (Capabilities.kv_window_only): one window group of every layer, rings, and no layer reads
    the block table, which the scheduler sends empty; BatchItem.block_table is then window group 0's ring by
    position."""
    prompt_logprobs: bool = True
    """It fills BatchItem.prompt_out (Describe.capabilities.prompt_logprobs)."""


class Backend(Protocol):
    info: BackendInfo

    def swap_out(self, mapping: BlockMap) -> None: ...

    def swap_in(self, mapping: BlockMap) -> None: ...

    def copy(self, mapping: BlockMap) -> None: ...

    def execute(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        """Run one forward pass; one entry per item, None where item.sample is False."""
        ...

    async def execute_async(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        """execute() as the server's event loop calls it: on a worker thread where a pass blocks (torch; its
        decode steps that the last one says are short run inline), inline where it does not (simulated, which
        then waits out its simulated latency)."""
        ...
