"""Per-request state of an executor, keyed by request id, and the checks on what it is told."""

from __future__ import annotations

from dataclasses import dataclass

from executor_service.backend import BatchItem, SamplingConfig
from protos.pagedserve.v1 import common_pb2, executor_pb2


class StepRefused(Exception):
    """The step as a whole is malformed; nothing in it runs."""


@dataclass(slots=True)
class RequestState:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_table: list[int] | None
    sampling: SamplingConfig


def sampling_config(p: common_pb2.SamplingParams) -> SamplingConfig:
    return SamplingConfig(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k if p.HasField("top_k") else -1,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
    )


class RequestTable:
    """Tracks which live requests hold each device block (several share a cached prefix or an n > 1
    prompt) and which request owns each swap block, and rejects what breaks that."""

    def __init__(self, num_device_blocks: int, num_swap_blocks: int, block_size: int, vocab_size: int = 0,
                 max_model_len: int = 0) -> None:
        self.num_device_blocks = num_device_blocks
        self.num_swap_blocks = num_swap_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.states: dict[str, RequestState] = {}
        self._device_owner: dict[int, set[str]] = {}
        self._swap_owner: dict[int, str] = {}

    def reset(self) -> None:
        self.states.clear()
        self._device_owner.clear()
        self._swap_owner.clear()

    def drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self._release_device(state)
        for block, owner in list(self._swap_owner.items()):
            if owner == request_id:
                del self._swap_owner[block]

    def _release_device(self, state: RequestState) -> None:
        for block in state.block_table or ():
            holders = self._device_owner.get(block)
            if holders is not None:
                holders.discard(state.request_id)
                if not holders:
                    del self._device_owner[block]
        state.block_table = None

    def apply_swaps(self, step: executor_pb2.StepRequest) -> None:
        """Check a step's swap-out, swap-in and copy mappings against block ownership, then record the
        moves. A refused step changes nothing."""
        swapped_out = set(step.swapped_out_ids)
        unknown = swapped_out - self.states.keys()
        if unknown:
            raise StepRefused(f"swapped_out_ids names unknown request {sorted(unknown)[0]!r}")
        released = {b for rid in swapped_out for b in self.states[rid].block_table or ()
                    if self._device_owner.get(b, set()) <= swapped_out}
        claimed = self._check_swap_out(step)
        destinations = [m.dst for m in step.swap_in] + [m.dst for m in step.copy]
        if len(set(destinations)) != len(destinations):
            raise StepRefused("a device block is the destination of more than one swap_in or copy")
        freed: set[int] = set()
        for m in step.swap_in:
            if m.src not in self._swap_owner or m.src in freed:
                raise StepRefused(f"swap_in source block {m.src} holds no swapped request")
            self._check_destination(m.dst, released, "swap_in destination")
            freed.add(m.src)
        for m in step.copy:
            if m.src not in self._device_owner or m.src in released:
                raise StepRefused(f"copy source block {m.src} is not held by any running request")
            self._check_destination(m.dst, released, "copy destination")
        self._swap_owner.update(claimed)
        for rid in swapped_out:
            self._release_device(self.states[rid])
        for block in freed:
            del self._swap_owner[block]

    def _check_swap_out(self, step: executor_pb2.StepRequest) -> dict[int, str]:
        """Each swap block's owner: a shared source block is copied once per holder being swapped out,
        its mappings in the order swapped_out_ids names them."""
        claimed: dict[int, str] = {}
        taken: dict[int, set[str]] = {}
        for m in step.swap_out:
            holders = self._device_owner.get(m.src, set())
            done = taken.setdefault(m.src, set())
            owner = next((r for r in step.swapped_out_ids if r in holders and r not in done), None)
            if owner is None:
                raise StepRefused(f"swap_out source block {m.src} is not held by a request being swapped out")
            done.add(owner)
            if not 0 <= m.dst < self.num_swap_blocks:
                raise StepRefused(f"swap block id {m.dst} out of range [0, {self.num_swap_blocks})")
            holder = self._swap_owner.get(m.dst) or claimed.get(m.dst)
            if holder is not None:
                raise StepRefused(f"swap block {m.dst} is already held by {holder!r}")
            claimed[m.dst] = owner
        return claimed

    def _check_destination(self, block: int, released: set[int], what: str) -> None:
        if not 0 <= block < self.num_device_blocks:
            raise StepRefused(f"{what} block id {block} out of range [0, {self.num_device_blocks})")
        holders = self._device_owner.get(block)
        if holders and block not in released:  # writing it would corrupt a live request's KV
            raise StepRefused(f"{what} block {block} is held by live request {sorted(holders)[0]!r}")

    def claim(self, request_id: str, blocks: list[int]) -> str:
        """Give blocks to a request; an error message (and nothing claimed) if any is bad."""
        for block in blocks:
            if not 0 <= block < self.num_device_blocks:
                return f"block id {block} out of range [0, {self.num_device_blocks})"
            if request_id in self._device_owner.get(block, ()):
                return f"block {block} is already in this request's table"
        if len(set(blocks)) != len(blocks):
            return "block ids repeat within one request"
        for block in blocks:
            self._device_owner.setdefault(block, set()).add(request_id)
        return ""

    def add_new(self, new: executor_pb2.NewRequest) -> str:
        self.drop(new.request_id)
        if new.num_computed_tokens + new.num_scheduled_tokens > len(new.token_ids):
            return "num_computed_tokens + num_scheduled_tokens exceeds the tokens sent"
        bad = next((t for t in new.token_ids if t >= self.vocab_size), None) if self.vocab_size else None
        if bad is not None:
            return f"token id {bad} outside the vocabulary [0, {self.vocab_size})"
        error = self.claim(new.request_id, list(new.block_ids))
        if error:
            return error
        self.states[new.request_id] = RequestState(
            new.request_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
            list(new.block_ids), sampling_config(new.sampling))
        return ""

    def update_running(self, request_id: str, new_block_ids: list[int], num_tokens: int, resumed: bool) -> str:
        state = self.states.get(request_id)
        if state is None:
            return f"unknown request {request_id!r}: send it as a new request"
        if resumed:
            self._release_device(state)
            state.block_table = []
        elif state.block_table is None:
            return "request is swapped out: resume it with its whole block table"
        if new_block_ids:
            error = self.claim(request_id, new_block_ids)
            if error:
                return error
            state.block_table.extend(new_block_ids)
        if state.num_computed + num_tokens > len(state.token_ids):
            return "num_scheduled_tokens goes past the request's known tokens"
        return ""

    def item(self, state: RequestState, num_tokens: int) -> BatchItem | str:
        end = state.num_computed + num_tokens
        if num_tokens < 1:
            return "num_scheduled_tokens must be at least 1"
        if self.max_model_len and end > self.max_model_len:
            return f"the step reaches {end} tokens, beyond max_model_len {self.max_model_len}"
        table = state.block_table or []
        if len(table) * self.block_size < end:
            return f"block table holds {len(table) * self.block_size} slots, step needs {end}"
        return BatchItem(state.request_id, state.token_ids, state.num_prompt_tokens, state.num_computed,
                         num_tokens, table, end == len(state.token_ids), state.sampling)
