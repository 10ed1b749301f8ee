"""The executor's one validator: a StepRequest checked against the request table before anything changes.

A malformed step raises StepRefused (nothing in it runs). A request that breaks a rule is refused alone
(RequestRefused, collected in the plan); the rest of the step runs. check_span is the rule for one request's
span of positions, shared with the torch backend's guard on its own input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from executor_service.state import AdmittedRequest, RequestState, RequestTable, StepPlan, sampling_config
from protos.contract import SAMPLING, SamplingParam, SamplingTable, released_before, split_columns
from protos.pagedserve.v1 import common_pb2, executor_pb2

MAX_NUM_STEPS = 64
MAX_NUM_LOOKAHEAD_SLOTS = 64
MAX_NUM_DRAFT_TOKENS = 16


class StepRefused(Exception):
    """The step as a whole is malformed; nothing in it runs."""


class RequestRefused(ValueError):
    """One request's part of a step breaks a rule; that request is dropped, the others run."""


@dataclass(slots=True)
class RunningColumns:
    """One running request of a step, read out of the RunningRequests columns."""

    request_id: str
    new_block_ids: list[int]
    num_tokens: int
    resumed: bool
    draft_token_ids: list[int]
    new_window_blocks: list[list[int]]  # per window group
    window_start: int
    num_model_drafts: int = 0


@dataclass(slots=True, frozen=True)
class StepLimits:
    """What one step may carry; Describe.capabilities advertises each, and a step beyond one is refused whole
    before anything in it is looked at (a step of thousands of requests must not run out of device memory)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_num_lookahead_slots: int = MAX_NUM_LOOKAHEAD_SLOTS
    max_num_steps: int = MAX_NUM_STEPS
    max_num_draft_tokens: int = MAX_NUM_DRAFT_TOKENS
    max_num_model_draft_tokens: int = MAX_NUM_DRAFT_TOKENS


def check_step_size(step: executor_pb2.StepRequest, limits: StepLimits) -> None:
    """The step's sizes against the per-step limits: StepRefused naming the first one it exceeds."""
    if step.num_steps > limits.max_num_steps:
        raise StepRefused(f"num_steps {step.num_steps} exceeds max_num_steps {limits.max_num_steps} "
                          "(Describe.capabilities)")
    if (step.running.draft_token_ids or any(step.running.num_model_draft_tokens)) and step.num_steps > 1:
        raise StepRefused("draft tokens need num_steps 1 (a verified step is not a multi-step decode)")
    if step.num_lookahead_slots > limits.max_num_lookahead_slots:
        raise StepRefused(f"num_lookahead_slots {step.num_lookahead_slots} exceeds max_num_lookahead_slots "
                          f"{limits.max_num_lookahead_slots} (Describe.capabilities)")
    seqs = len(step.new_requests) + len(step.running.request_ids)
    if seqs > limits.max_num_seqs:
        raise StepRefused(f"the step schedules {seqs} requests, more than max_num_seqs {limits.max_num_seqs} "
                          "(Describe.capabilities)")
    tokens = (sum(n.num_scheduled_tokens for n in step.new_requests) + sum(step.running.num_scheduled_tokens)
              + len(step.running.draft_token_ids) + sum(step.running.num_model_draft_tokens))
    if tokens > limits.max_num_batched_tokens:
        raise StepRefused(f"the step schedules {tokens} tokens, more than max_num_batched_tokens "
                          f"{limits.max_num_batched_tokens} (Describe.capabilities)")


SAMPLING_NAMES = tuple(f.name for f in fields(SamplingTable))


def check_sampling(p: common_pb2.SamplingParams, max_logprobs: int) -> None:
    """Every sampling value against its range in the contract's SAMPLING table (the scheduler's validation reads
    the same table); a float must also be finite, and logprobs and prompt_logprobs at most the executor's
    max_logprobs."""
    by_name = p.DESCRIPTOR.fields_by_name
    for name in SAMPLING_NAMES:
        field = by_name.get(name)
        if field is None or (field.has_presence and not p.HasField(name)):
            continue
        param: SamplingParam[Any] = getattr(SAMPLING, name)
        high = max_logprobs if name in ("logprobs", "prompt_logprobs") else None
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        for value in getattr(p, name).values() if is_map else (getattr(p, name),):  # a map: each of its values
            finite = not isinstance(value, float) or math.isfinite(value)
            if not (finite and param.allows(value) and (high is None or value <= high)):
                raise RequestRefused(f"sampling.{name}: must be {param.describe(high)}, got {value}")


def check_span(start: int, num_tokens: int, num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Positions [start, start + num_tokens) fit max_model_len and a block table of num_blocks blocks."""
    end = start + num_tokens
    if num_tokens < 1:
        raise RequestRefused("num_scheduled_tokens must be at least 1")
    if max_model_len and end > max_model_len:
        raise RequestRefused(f"the step reaches {end} tokens, beyond max_model_len {max_model_len}")
    needed = -(-end // block_size)
    if num_blocks < needed:
        raise RequestRefused(f"{end} tokens need {needed} blocks, the block table has {num_blocks}")


def running_columns(run: executor_pb2.RunningRequests, window_groups: int = 0) -> list[RunningColumns]:
    ids, nums, counts = list(run.request_ids), list(run.num_scheduled_tokens), list(run.num_new_blocks)
    resumed = list(run.resumed) or [False] * len(ids)
    if not len(ids) == len(nums) == len(counts) == len(resumed) or sum(counts) != len(run.new_block_ids):
        raise StepRefused("running: request_ids, num_scheduled_tokens, num_new_blocks and resumed must be "
                          "columns of one length, and num_new_blocks must add up to len(new_block_ids)")
    blocks = split_columns(run.new_block_ids, counts) if any(counts) else [[] for _ in ids]
    windows, starts = window_columns(run, len(ids), window_groups)
    return [RunningColumns(*row) for row in zip(ids, blocks, nums, resumed, draft_columns(run, len(ids)), windows,
                                                 starts, model_draft_column(run, len(ids)), strict=True)]


def window_columns(run: executor_pb2.RunningRequests, num_requests: int,
                   window_groups: int) -> tuple[list[list[list[int]]], list[int]]:
    """Each running request's new window-group blocks (per group) and window_block_start; StepRefused if the
    columns disagree, or come to an executor without window groups."""
    counts, starts = list(run.num_new_window_blocks), list(run.window_block_start)
    if not counts and not starts and not run.new_window_block_ids:
        return [[[] for _ in range(window_groups)] for _ in range(num_requests)], [0] * num_requests
    if not window_groups:
        raise StepRefused("running: window blocks sent, but this executor keeps no window tables "
                          "(Capabilities.kv_window_groups is 0)")
    if len(counts) != num_requests or len(starts) != num_requests \
            or sum(counts) * window_groups != len(run.new_window_block_ids):
        raise StepRefused("running: num_new_window_blocks and window_block_start must be columns of request_ids' "
                          f"length, and {window_groups} x sum(num_new_window_blocks) must be "
                          "len(new_window_block_ids)")
    runs = split_columns(run.new_window_block_ids, [n * window_groups for n in counts])
    return [[blocks[g * n:(g + 1) * n] for g in range(window_groups)] for blocks, n in zip(runs, counts,
                                                                                          strict=True)], starts


def model_draft_column(run: executor_pb2.RunningRequests, num_requests: int) -> list[int]:
    """Each running request's count of draft-model tokens (0 when the column is empty); StepRefused if the column
    is not one per request."""
    counts = list(run.num_model_draft_tokens)
    if not counts:
        return [0] * num_requests
    if len(counts) != num_requests:
        raise StepRefused("running: num_model_draft_tokens must be a column of request_ids' length")
    return counts


def draft_columns(run: executor_pb2.RunningRequests, num_requests: int) -> list[list[int]]:
    """Each running request's draft tokens (none when the column is empty); StepRefused if the columns disagree."""
    counts = list(run.num_draft_tokens)
    if not counts:
        if run.draft_token_ids:
            raise StepRefused("running: draft_token_ids given without num_draft_tokens")
        return [[] for _ in range(num_requests)]
    if len(counts) != num_requests or sum(counts) != len(run.draft_token_ids):
        raise StepRefused("running: num_draft_tokens must be a column of request_ids' length adding up to "
                          "len(draft_token_ids)")
    return split_columns(run.draft_token_ids, counts)


class _Ownership:
    """Who holds each device block as the step would leave it, over the table's, without changing the table."""

    def __init__(self, holders: dict[int, set[str]]) -> None:
        self._holders = holders
        self._freed: dict[int, set[str]] = {}
        self._taken: dict[int, set[str]] = {}

    def holds(self, request_id: str, block: int) -> bool:
        if request_id in self._taken.get(block, ()):
            return True
        return request_id in self._holders.get(block, ()) and request_id not in self._freed.get(block, ())

    def free(self, request_id: str, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._freed.setdefault(block, set()).add(request_id)
            self._taken.get(block, set()).discard(request_id)

    def take(self, request_id: str, blocks: Iterable[int]) -> None:
        for block in blocks:
            self._taken.setdefault(block, set()).add(request_id)


class StepValidator:
    def __init__(self, table: RequestTable, limits: StepLimits | None = None, max_logprobs: int = 20) -> None:
        self.table = table
        self.limits = limits or StepLimits()
        self.max_logprobs = max_logprobs

    def check(self, step: executor_pb2.StepRequest) -> tuple[StepPlan, list[RunningColumns]]:
        """The plan of a step (StepRefused if it is malformed or too large) and its running requests, in step
        order."""
        check_step_size(step, self.limits)
        running = running_columns(step.running, self.table.window_groups)
        ids = [n.request_id for n in step.new_requests] + [r.request_id for r in running]
        if len(set(ids)) != len(ids):
            raise StepRefused("a request id appears more than once among new_requests and running")
        plan = StepPlan()
        ownership = _Ownership(self.table.device_owner)
        self._check_swaps(step, plan, ownership)
        for new in step.new_requests:
            try:
                admitted = self._new(new, ownership)
            except RequestRefused as e:
                self._refuse(plan, ownership, new.request_id, e)
                continue
            self._accept(plan, ownership, admitted)
        for r in running:
            try:
                admitted = self._running(r, plan, ownership)
            except RequestRefused as e:
                self._refuse(plan, ownership, r.request_id, e)
                continue
            self._accept(plan, ownership, admitted)
        return plan, running

    @staticmethod
    def _accept(plan: StepPlan, ownership: _Ownership, admitted: AdmittedRequest) -> None:
        blocks = admitted.new_blocks()
        if blocks:
            ownership.take(admitted.request_id, blocks)
        plan.admitted.append(admitted)

    def _refuse(self, plan: StepPlan, ownership: _Ownership, request_id: str, error: RequestRefused) -> None:
        plan.refused[request_id] = str(error)
        plan.dropped_ids.append(request_id)
        state = self.table.states.get(request_id)
        if state is not None:
            ownership.free(request_id, state.held_blocks())

    def _new(self, new: executor_pb2.NewRequest, ownership: _Ownership) -> AdmittedRequest:
        old = self.table.states.get(new.request_id)
        if old is not None:  # sent again as new: its old state goes first
            ownership.free(new.request_id, old.held_blocks())
        num_sent = len(new.token_ids)
        if new.num_computed_tokens + new.num_scheduled_tokens > num_sent:
            raise RequestRefused("num_computed_tokens + num_scheduled_tokens exceeds the tokens sent")
        if new.num_prompt_tokens > num_sent:
            raise RequestRefused(f"num_prompt_tokens {new.num_prompt_tokens} exceeds the {num_sent} tokens sent")
        max_len = self.table.max_model_len
        if max_len and num_sent > max_len:
            raise RequestRefused(f"{num_sent} tokens sent, beyond max_model_len {max_len}")
        check_sampling(new.sampling, self.max_logprobs)
        vocab = self.table.vocab_size
        bad = next((t for t in new.token_ids if t >= vocab), None) if vocab else None
        if bad is not None:
            raise RequestRefused(f"token id {bad} outside the vocabulary [0, {vocab})")
        blocks = list(new.block_ids)
        windows = self._new_windows(new)
        self._check_claim(new.request_id, blocks + [b for group in windows for b in group], ownership)
        self._check_span(new.num_computed_tokens, new.num_scheduled_tokens, len(blocks))
        self._check_window_span(new.num_computed_tokens, new.num_scheduled_tokens, new.window_block_start,
                                new.window_block_start + (len(windows[0]) if windows else 0))
        state = RequestState(new.request_id, list(new.token_ids), new.num_prompt_tokens, new.num_computed_tokens,
                             [], sampling_config(new.sampling), new.window_block_start,
                             [[] for _ in range(self.table.window_groups)])
        return AdmittedRequest(new.request_id, new.num_scheduled_tokens, blocks, new=state,
                               window_start=new.window_block_start, new_window_blocks=windows)

    def _new_windows(self, new: executor_pb2.NewRequest) -> list[list[int]]:
        """A new request's window-group tables (none without window groups)."""
        groups, ids = self.table.window_groups, list(new.window_block_ids)
        if not groups:
            if ids or new.window_block_start:
                raise RequestRefused("window_block_ids: this executor keeps no window tables "
                                     "(Capabilities.kv_window_groups is 0)")
            return []
        if len(ids) % groups:
            raise RequestRefused(f"window_block_ids: {len(ids)} blocks do not make {groups} tables of one length")
        n = len(ids) // groups
        return [ids[g * n:(g + 1) * n] for g in range(groups)]

    def _check_window_span(self, start: int, num_tokens: int, first: int, end: int) -> None:
        """The window tables (blocks [first, end)) hold every position the step's queries read and write."""
        if not self.table.window_groups:
            return
        t = self.table
        if t.window_ring:
            self._check_ring(start, num_tokens, first, end)
            return
        needed = released_before(start, t.window, t.block_size)
        if first > needed:
            raise RequestRefused(f"window tables start at block {first}, but the step reads block {needed}")
        try:
            check_span(start, num_tokens, end, t.block_size, t.max_model_len)
        except RequestRefused as e:
            raise RequestRefused(f"window tables: {e}") from None

    def _check_ring(self, start: int, num_tokens: int, first: int, length: int) -> None:
        """Ring window tables (Capabilities.kv_window_ring): from block 0, at most R blocks, and as many as the
        step's positions reach below R."""
        t = self.table
        if first:
            raise RequestRefused(f"window_block_start {first}: window tables are rings (Capabilities."
                                 "kv_window_ring), which start at 0")
        if length > t.ring_size:
            raise RequestRefused(f"window tables: a ring of {length} blocks, more than its {t.ring_size}")
        covered = length if length < t.ring_size else -(-(start + num_tokens) // t.block_size)
        try:
            check_span(start, num_tokens, covered, t.block_size, t.max_model_len)
        except RequestRefused as e:
            raise RequestRefused(f"window tables: {e}") from None

    def _running(self, r: RunningColumns, plan: StepPlan, ownership: _Ownership) -> AdmittedRequest:
        state = self.table.states.get(r.request_id)
        if state is None:
            raise RequestRefused(f"unknown request {r.request_id!r}: send it as a new request")
        held = state.block_table or []
        window_first, window_end = state.window_start, state.window_end
        if r.resumed:
            ownership.free(r.request_id, state.held_blocks())
            held = []
            window_first = window_end = r.window_start
        elif state.block_table is None or r.request_id in plan.swapped_out_ids:
            raise RequestRefused("request is swapped out: resume it with its whole block table")
        elif r.window_start:
            raise RequestRefused("window_block_start is for resumed requests only (0 for the others)")
        new_blocks = r.new_block_ids + [b for group in r.new_window_blocks for b in group]
        if new_blocks:
            self._check_claim(r.request_id, new_blocks, ownership)
        if state.num_computed + r.num_tokens > len(state.token_ids):
            raise RequestRefused("num_scheduled_tokens goes past the request's known tokens")
        if r.draft_token_ids:
            self._check_drafts(state, r)
        if r.num_model_drafts:
            self._check_model_drafts(state, r)
        span = r.num_tokens + len(r.draft_token_ids) + r.num_model_drafts
        self._check_span(state.num_computed, span, len(held) + len(r.new_block_ids))
        window_end += len(r.new_window_blocks[0]) if r.new_window_blocks else 0
        self._check_window_span(state.num_computed, span, window_first, window_end)
        return AdmittedRequest(r.request_id, r.num_tokens, r.new_block_ids, r.resumed, None, r.draft_token_ids,
                               r.window_start, r.new_window_blocks, r.num_model_drafts)

    def _check_model_drafts(self, state: RequestState, r: RunningColumns) -> None:
        """Draft-model tokens: an executor with a draft model, within its count, after the request's last token,
        not with given drafts."""
        most = self.limits.max_num_model_draft_tokens
        if r.num_model_drafts > most:
            raise RequestRefused(f"num_model_draft_tokens {r.num_model_drafts} exceeds max_num_model_draft_tokens "
                                 f"{most} (Describe.capabilities; 0: no --draft-model)")
        if r.draft_token_ids:
            raise RequestRefused("a request carries draft_token_ids or num_model_draft_tokens, not both")
        if state.num_computed + r.num_tokens != len(state.token_ids):
            raise RequestRefused("num_model_draft_tokens needs num_scheduled_tokens to reach the request's last token")

    def _check_drafts(self, state: RequestState, r: RunningColumns) -> None:
        """Drafts follow the request's last token, within the advertised count and the vocabulary."""
        most = self.limits.max_num_draft_tokens
        if len(r.draft_token_ids) > most:
            raise RequestRefused(f"{len(r.draft_token_ids)} draft tokens, more than max_num_draft_tokens {most} "
                                 "(Describe.capabilities)")
        if state.num_computed + r.num_tokens != len(state.token_ids):
            raise RequestRefused("draft tokens need num_scheduled_tokens to reach the request's last token")
        vocab = self.table.vocab_size
        bad = next((t for t in r.draft_token_ids if t >= vocab), None) if vocab else None
        if bad is not None:
            raise RequestRefused(f"draft token id {bad} outside the vocabulary [0, {vocab})")

    def _check_span(self, start: int, num_tokens: int, num_blocks: int) -> None:
        """The block table holds the step's positions; a window-only model's is empty (its rings hold them)."""
        if self.table.window_only:
            if num_blocks:
                raise RequestRefused(f"block_ids: {num_blocks} blocks sent, but every layer of this model slides "
                                     "(Capabilities.kv_window_only): send its window rings only")
            return
        check_span(start, num_tokens, num_blocks, self.table.block_size, self.table.max_model_len)

    def _check_claim(self, request_id: str, blocks: Sequence[int], ownership: _Ownership) -> None:
        num_device_blocks = self.table.num_device_blocks
        for block in blocks:  # another live request may hold the block too: a shared prefix
            if not 0 <= block < num_device_blocks:
                raise RequestRefused(f"block id {block} out of range [0, {num_device_blocks})")
            if ownership.holds(request_id, block):
                raise RequestRefused(f"block {block} is already in this request's table")
        if len(set(blocks)) != len(blocks):
            raise RequestRefused("block ids repeat within one request")

    def _check_swaps(self, step: executor_pb2.StepRequest, plan: StepPlan, ownership: _Ownership) -> None:
        """swap_out, swap_in and copy against block ownership: a mapping that would overwrite a live
        request's KV, or read a block nobody holds, refuses the whole step."""
        states, device_owner, swap_owner = self.table.states, self.table.device_owner, self.table.swap_owner
        swapped_out = set(step.swapped_out_ids)
        unknown = swapped_out - states.keys()
        if unknown:
            raise StepRefused(f"swapped_out_ids names unknown request {sorted(unknown)[0]!r}")
        released = {b for rid in swapped_out for b in states[rid].held_blocks()
                    if device_owner.get(b, set()) <= swapped_out}
        claimed = self._check_swap_out(step)
        destinations = [m.dst for m in step.swap_in] + [m.dst for m in step.copy]
        if len(set(destinations)) != len(destinations):
            raise StepRefused("a device block is the destination of more than one swap_in or copy")
        freed: set[int] = set()
        for m in step.swap_in:
            if m.src not in swap_owner or m.src in freed:
                raise StepRefused(f"swap_in source block {m.src} holds no swapped request")
            self._check_destination(m.dst, released, "swap_in destination")
            freed.add(m.src)
        for m in step.copy:
            if m.src not in device_owner or m.src in released:
                raise StepRefused(f"copy source block {m.src} is not held by any running request")
            self._check_destination(m.dst, released, "copy destination")
        plan.swapped_out_ids, plan.swap_claims, plan.swap_frees = swapped_out, claimed, freed
        for rid in swapped_out:
            ownership.free(rid, states[rid].held_blocks())

    def _check_swap_out(self, step: executor_pb2.StepRequest) -> dict[int, str]:
        """Each swap block's owner: a shared source block is copied once per holder being swapped out,
        its mappings in the order swapped_out_ids names them."""
        claimed: dict[int, str] = {}
        taken: dict[int, set[str]] = {}
        num_swap_blocks, swap_owner = self.table.num_swap_blocks, self.table.swap_owner
        for m in step.swap_out:
            holders = self.table.device_owner.get(m.src, set())
            done = taken.setdefault(m.src, set())
            owner = next((r for r in step.swapped_out_ids if r in holders and r not in done), None)
            if owner is None:
                raise StepRefused(f"swap_out source block {m.src} is not held by a request being swapped out")
            done.add(owner)
            if not 0 <= m.dst < num_swap_blocks:
                raise StepRefused(f"swap block id {m.dst} out of range [0, {num_swap_blocks})")
            holder = swap_owner.get(m.dst) or claimed.get(m.dst)
            if holder is not None:
                raise StepRefused(f"swap block {m.dst} is already held by {holder!r}")
            claimed[m.dst] = owner
        return claimed

    def _check_destination(self, block: int, released: set[int], what: str) -> None:
        num_device_blocks = self.table.num_device_blocks
        if not 0 <= block < num_device_blocks:
            raise StepRefused(f"{what} block id {block} out of range [0, {num_device_blocks})")
        holders = self.table.device_owner.get(block)
        if holders and block not in released:  # writing it would corrupt a live request's KV
            raise StepRefused(f"{what} block {block} is held by live request {sorted(holders)[0]!r}")
