"""Per-request state of an executor, keyed by request id, and who owns each device and swap block.

The table changes only through commit(plan), with a plan that executor_service/validator.py checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from executor_service.backend import BatchItem, SamplingConfig
from protos.contract import released_before, ring_blocks, ring_table
from protos.pagedserve.v1 import common_pb2

OPTIONAL_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "repetition_penalty", "logprobs",
                            "prompt_logprobs")


@dataclass(slots=True)
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int] | None
    sampling: SamplingConfig
    window_start: int = 0
    windows: list[list[int]] = field(default_factory=list)  # per window group: its blocks from window_start on
    draft_computed: int = 0
    """Speculative decoding with a draft model: its KV holds this request's positions [0, draft_computed)."""

    def held_blocks(self) -> list[int]:
        return [*(self.block_table or ()), *(b for group in self.windows for b in group)]

    @property
    def window_end(self) -> int:
        return self.window_start + (len(self.windows[0]) if self.windows else 0)


@dataclass(slots=True)
class AdmittedRequest:
    """One request's accepted part of a step: a new request in full, or a running one's new blocks."""

    request_id: str
    num_tokens: int
    new_block_ids: list[int]
    resumed: bool = False
    new: RequestState | None = None
    draft_token_ids: list[int] = field(default_factory=list)
    window_start: int = 0
    new_window_blocks: list[list[int]] = field(default_factory=list)  # per window group (whole when new or resumed)
    num_model_drafts: int = 0

    def new_blocks(self) -> list[int]:
        return [*self.new_block_ids, *(b for group in self.new_window_blocks for b in group)]


@dataclass(slots=True)
class StepPlan:
    """What a checked step changes in the table, and the requests it refuses (request id -> reason)."""

    swapped_out_ids: set[str] = field(default_factory=set)
    swap_claims: dict[int, str] = field(default_factory=dict)
    swap_frees: set[int] = field(default_factory=set)
    dropped_ids: list[str] = field(default_factory=list)
    admitted: list[AdmittedRequest] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


def sampling_config(p: common_pb2.SamplingParams) -> SamplingConfig:
    """The sampler's view of a request's SamplingParams; an unset optional field is SamplingConfig's default
    (protos/contract.py's SAMPLING table). min_tokens and stop_token_ids come along: the sampler masks those ids
    and EOS until min_tokens are out."""
    given = {name: getattr(p, name) for name in OPTIONAL_SAMPLING_FIELDS if p.HasField(name)}
    return SamplingConfig(min_p=p.min_p, presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, min_tokens=p.min_tokens,
                          stop_token_ids=tuple(p.stop_token_ids), logit_bias=tuple(sorted(p.logit_bias.items())),
                          **given)


class RequestTable:
    """The executor's requests, which live requests hold each device block (several share a cached prefix
    or an n > 1 prompt) and which request owns each swap block; the validator reads it, commit() changes it."""

    def __init__(self, num_device_blocks: int, num_swap_blocks: int, block_size: int, vocab_size: int = 0,
                 max_model_len: int = 0, window_groups: int = 0, window: int = 0, window_ring: bool = False,
                 window_only: bool = False) -> None:
        self.num_device_blocks = num_device_blocks
        self.num_swap_blocks = num_swap_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.window_groups = window_groups
        self.window = window
        self.window_ring = window_ring  # window tables are rings of ring_size blocks (Capabilities.kv_window_ring)
        self.ring_size = ring_blocks(window, block_size) if window_ring else 0
        self.window_only = window_only and window_ring  # no layer reads the block table (Capabilities.kv_window_only)
        self.states: dict[str, RequestState] = {}
        self.device_owner: dict[int, set[str]] = {}
        self.swap_owner: dict[int, str] = {}

    def reset(self) -> None:
        self.states.clear()
        self.device_owner.clear()
        self.swap_owner.clear()

    def drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self._release_device(state)
        for block, owner in list(self.swap_owner.items()):
            if owner == request_id:
                del self.swap_owner[block]

    def _release_device(self, state: RequestState) -> None:
        self._release_blocks(state.request_id, state.held_blocks())
        state.block_table = None
        state.windows = []

    def _release_blocks(self, request_id: str, blocks: list[int]) -> None:
        for block in blocks:
            holders = self.device_owner.get(block)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self.device_owner[block]

    def release_out_of_window(self, request_id: str) -> None:
        """After a step: the request stops holding its window blocks that no query of it reads again
        (protos.contract.released_before); the scheduler may give them to others from the next step on."""
        state = self.states.get(request_id)
        if state is None or not state.windows or self.window_ring:  # a ring is kept until the request ends
            return
        cut = min(released_before(state.num_computed, self.window, self.block_size), state.window_end)
        cut -= state.window_start
        if cut <= 0:
            return
        self._release_blocks(request_id, [b for group in state.windows for b in group[:cut]])
        for group in state.windows:
            del group[:cut]
        state.window_start += cut

    def window_blocks_covered(self, state: RequestState, end: int) -> int:
        """How many leading blocks of the request's positions its window tables hold, asked for positions up to
        `end` (a full ring holds every block: that many)."""
        if self.window_ring and state.windows and len(state.windows[0]) >= self.ring_size:
            return -(-end // self.block_size)
        return state.window_end

    def commit(self, plan: StepPlan) -> None:
        """Apply a checked step: swaps first, then refused and re-sent requests leave, then admitted ones
        take their blocks."""
        self.swap_owner.update(plan.swap_claims)
        for rid in plan.swapped_out_ids:
            self._release_device(self.states[rid])
        for block in plan.swap_frees:
            del self.swap_owner[block]
        for rid in plan.dropped_ids:
            self.drop(rid)
        for admitted in plan.admitted:
            self._admit(admitted)

    def _admit(self, admitted: AdmittedRequest) -> None:
        rid = admitted.request_id
        if admitted.new is not None:
            self.drop(rid)  # sent again as new: the old state goes
            self.states[rid] = admitted.new
        state = self.states[rid]
        if admitted.resumed or state.block_table is None:  # the validator admits a swapped-out one only resumed
            self._release_device(state)
            state.block_table = []
            state.window_start = admitted.window_start
            state.windows = [[] for _ in range(self.window_groups)]
        state.block_table.extend(admitted.new_block_ids)
        for group, new in zip(state.windows, admitted.new_window_blocks, strict=False):
            group.extend(new)
        for block in admitted.new_blocks():
            self.device_owner.setdefault(block, set()).add(rid)

    def item(self, state: RequestState, num_tokens: int, draft_token_ids: list[int] | None = None,
             num_model_drafts: int = 0) -> BatchItem:
        """The batch item of a request the validator admitted (or check_span accepted) for num_tokens, and the
        drafts it verifies (given, or proposed by the backend's draft model)."""
        end = state.num_computed + num_tokens
        if self.window_ring:
            windows = [ring_table(group, end + len(draft_token_ids or ()) + num_model_drafts, self.block_size,
                                  self.ring_size) for group in state.windows]
        else:
            windows = [[0] * state.window_start + group for group in state.windows]  # positions before: never read
        table = windows[0] if self.window_only else state.block_table or []  # window-only: the ring by position
        return BatchItem(state.request_id, state.token_ids, state.num_prompt_tokens, state.num_computed,
                         num_tokens, table, end == len(state.token_ids), state.sampling,
                         draft_token_ids or (), window_tables=windows, num_model_drafts=num_model_drafts,
                         draft_start=min(state.draft_computed, state.num_computed))

