"""Continuous batching over paged KV blocks: schedule() then update(), once per step."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from scheduler_service.core.block_manager import AllocStatus, BlockManager
from scheduler_service.core.config import CoreConfig, ModelLimits, PreemptionMode, Victim
from scheduler_service.core.outputs import (
    ExecutorResult,
    RequestDelta,
    ScheduledWork,
    SchedulerOutput,
)
from scheduler_service.core.policy import Policy, WaitingQueue, sort_key
from scheduler_service.core.request import FinishReason, Request, RequestStatus, SamplingOptions


def stop_reason(sampling: SamplingOptions, token: int, num_output: int, num_tokens: int, max_model_len: int,
                eos_ids: tuple[int, ...]) -> FinishReason | None:
    """Why a request stops after appending token (now num_output outputs, num_tokens in all), or None."""
    if num_tokens >= max_model_len:
        return FinishReason.LENGTH
    if num_output < sampling.min_tokens:
        return None
    if (not sampling.ignore_eos and token in eos_ids) or token in sampling.stop_token_ids:
        return FinishReason.STOPPED
    if num_output >= sampling.max_tokens:
        return FinishReason.LENGTH
    return None


class Ahead(enum.Enum):
    SCHEDULED = "scheduled"
    WAITS = "waits"
    ENDS = "ends"


@dataclass(slots=True)
class Budget:
    tokens: int
    seqs: int


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    device_usage: float
    cpu_usage: float
    device_blocks_used: int
    cpu_blocks_used: int
    num_preemptions_swap: int
    num_preemptions_recompute: int
    num_swapped_in_blocks: int
    num_swapped_out_blocks: int


class Scheduler:
    def __init__(self, config: CoreConfig, limits: ModelLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limits = limits
        self.clock = clock
        self.blocks = BlockManager(limits.num_device_blocks, limits.num_cpu_blocks, limits.block_size,
                                   config.watermark)
        self.waiting = WaitingQueue(config.policy, config.aging_rate, config.max_waiting_time)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._known_by_executor: set[str] = set()
        self._to_drop: list[str] = []
        self._step_id = 0
        self._admissions = 0
        self._step_first_admission = 0
        self._entered: list[ScheduledWork] = []
        self._running_dirty = False
        self._decode_works: dict[str, ScheduledWork] = {}
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0
        self._preemptions = {PreemptionMode.SWAP: 0, PreemptionMode.RECOMPUTE: 0}
        self._swapped_in_blocks = 0
        self._swapped_out_blocks = 0
        self._unupdated: list[SchedulerOutput] = []
        self._inflight: dict[str, tuple[ScheduledWork, int]] = {}

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` for one that already ran (moved off a lost or draining executor)."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.push(request, front=front)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORTED)
        self._compact_running()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting), num_swapped=len(self.swapped),
            device_usage=self.blocks.device.usage(), cpu_usage=self.blocks.cpu.usage(),
            device_blocks_used=self.blocks.device.num_used, cpu_blocks_used=self.blocks.cpu.num_used,
            num_preemptions_swap=self._preemptions[PreemptionMode.SWAP],
            num_preemptions_recompute=self._preemptions[PreemptionMode.RECOMPUTE],
            num_swapped_in_blocks=self._swapped_in_blocks, num_swapped_out_blocks=self._swapped_out_blocks,
        )

    def reset_executor(self) -> None:
        """The executor lost its state: every running and swapped request recomputes from WAITING."""
        lost = sorted([*self.running, *self.swapped], key=lambda r: r.arrival_time, reverse=True)
        for request in lost:
            self.blocks.free(request.request_id)
            request.num_computed_tokens = 0
            self.waiting.push(request, front=True)
        self.running.clear()
        self.swapped.clear()
        self._known_by_executor.clear()
        self._to_drop.clear()
        self._unupdated.clear()
        self._inflight = {}

    def release(self, request_id: str) -> Request | None:
        """Take a WAITING request out of this scheduler, to hand it to another executor's; None if the
        request is not here or not waiting (a running request finishes where its blocks are)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING:
            return None
        self.waiting.discard(request)
        self.blocks.free(request_id)
        self._forget_in_executor(request_id)
        del self.requests[request_id]
        return request

    def waiting_ids(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.status is RequestStatus.WAITING]

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of a prompt this executor's KV cache already holds (placement hint).
        Always 0 until the KV-cache manager caches prefixes."""
        return 0

    def set_limits(self, limits: ModelLimits) -> None:
        """Resize to a (re)connected executor's pools; only with no request holding blocks."""
        if self.running or self.swapped:
            raise RuntimeError("set_limits needs every request out of RUNNING and SWAPPED")
        self.limits = limits
        self.blocks = BlockManager(limits.num_device_blocks, limits.num_cpu_blocks, limits.block_size,
                                   self.config.watermark)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. With async scheduling it may run before update() of the step before it (the
        executor is still running that one): see _schedule_ahead."""
        self._inflight = self._works_in_flight() if self._unupdated else {}
        self._step_id += 1
        self._step_first_admission = self._admissions
        now = self.clock()
        out = SchedulerOutput(step_id=self._step_id, num_lookahead_slots=self.config.num_lookahead_slots)
        out.num_steps = self._num_steps()
        budget = Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        scheduled: dict[str, ScheduledWork] = {}
        self._schedule_running(budget, scheduled, out)
        if not out.num_preempted:
            self._schedule_swapped(budget, scheduled, out)
        if not out.num_preempted and not self.swapped and self._passed_delay(now):
            self._schedule_waiting(budget, scheduled, out, now)
        if out.num_steps > 1 and any(w.is_new or w.request.num_tokens - w.request.num_computed_tokens > 1
                                     for w in scheduled.values()):
            out.num_steps = 1
        self.blocks.end_step()
        out.scheduled = list(scheduled.values())
        # Work that was running before this step is known to the executor and was scheduled before:
        # only new and resumed work can change either (this keeps the step O(changes) here).
        for work in self._entered:
            if scheduled.get(work.request.request_id) is work:
                self._known_by_executor.add(work.request.request_id)
                if work.request.first_scheduled_time is None:
                    work.request.first_scheduled_time = now
        self._entered.clear()
        out.finished_ids, self._to_drop = self._to_drop, []
        if self.config.async_scheduling:
            self._unupdated.append(out)
        return out

    def _works_in_flight(self) -> dict[str, tuple[ScheduledWork, int]]:
        """Per request with steps not yet updated: its first such work and how many steps it is in."""
        first, *later = self._unupdated
        running = RequestStatus.RUNNING  # a finished request's id may already name a new request
        inflight = {w.request.request_id: (w, 1) for w in first.scheduled if w.request.status is running}
        for out in later:
            for w in out.scheduled:
                if w.request.status is not running:
                    continue
                rid = w.request.request_id
                known = inflight.get(rid)
                inflight[rid] = (w, 1) if known is None else (known[0], known[1] + 1)
        return inflight

    def _num_steps(self) -> int:
        k = self.config.num_scheduler_steps
        if k > 1 and not self._inflight and all(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return k
        return 1

    def _chunk(self, request: Request, budget: Budget) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget.tokens else 0
        n = min(remaining, budget.tokens)
        if self.config.long_prefill_token_threshold > 0 and remaining > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _slots_needed(self, request: Request, num_tokens: int, num_steps: int) -> int:
        return request.num_computed_tokens + num_tokens + (num_steps - 1) + self.config.num_lookahead_slots

    def _schedule_running(self, budget: Budget, scheduled: dict[str, ScheduledWork],
                          out: SchedulerOutput) -> None:
        # Fast path, the same decisions as _schedule_one_running: a one-token decode whose block table
        # already covers its slots needs no growth, no room and no new blocks. Its work is the same
        # every step, so each request's is made once and reused (work is read-only to consumers).
        extra = out.num_steps - 1 + self.config.num_lookahead_slots
        block_size = self.blocks.block_size
        tables = self.blocks._device_tables
        usable = self.blocks.device.num_blocks - self.blocks.watermark_blocks
        running_status = RequestStatus.RUNNING
        decode_works = self._decode_works
        inflight = self._inflight
        tokens_left, seqs_used = budget.tokens, 0
        for request in list(self.running):
            if request.status is not running_status:
                continue
            if tokens_left <= 0:
                break
            if inflight and request.request_id in inflight:
                ahead = self._schedule_ahead(request, *inflight[request.request_id], out, scheduled)
                tokens_left -= ahead is Ahead.SCHEDULED
                seqs_used += ahead is not Ahead.ENDS
                continue
            computed = request.num_computed_tokens
            if len(request.prompt_token_ids) + len(request.output_token_ids) - computed == 1:
                rid = request.request_id
                table = tables.get(rid)
                if table is not None and computed + 1 + extra <= len(table) * block_size and len(table) <= usable:
                    work = decode_works.get(rid)
                    if work is None:
                        work = decode_works[rid] = ScheduledWork(request, 1, [])
                    scheduled[rid] = work
                    tokens_left -= 1
                    seqs_used += 1
                    continue
            budget.tokens, budget.seqs, seqs_used = tokens_left, budget.seqs - seqs_used, 0
            self._schedule_one_running(request, budget, scheduled, out)
            tokens_left = budget.tokens
        budget.tokens, budget.seqs = tokens_left, budget.seqs - seqs_used

    def _schedule_ahead(self, request: Request, inflight: ScheduledWork, num_inflight: int, out: SchedulerOutput,
                        scheduled: dict[str, ScheduledWork]) -> Ahead:
        """Async scheduling: one more decode for a request whose last step(s) the executor is still running
        (the first of them `inflight`, num_inflight in all, each after the first a one-token decode). The
        executor feeds it its own freshly sampled tokens; update() of those steps runs first. Only when
        they sample, the request surely goes on (not at max_tokens or max_model_len: a token past an
        EOS or stop is dropped by update()), and its blocks grow without preempting anyone. A request
        that waits keeps its place among max_num_seqs; one that surely ends there gives it up."""
        num_output = len(request.output_token_ids)
        num_tokens = len(request.prompt_token_ids) + num_output
        if out.num_steps > 1 or request.num_computed_tokens + inflight.num_tokens < num_tokens:
            return Ahead.WAITS
        total = num_tokens + num_inflight  # its tokens once the steps in flight are done
        if num_output + num_inflight >= request.sampling.max_tokens or total >= self.limits.max_model_len:
            return Ahead.ENDS
        slots = total + self.config.num_lookahead_slots
        rid = request.request_id
        table = self.blocks._device_tables.get(rid)
        if table is not None and slots <= len(table) * self.blocks.block_size:
            new_ids: list[int] = []  # the table covers it: the common case, no block manager call
        elif self.blocks.can_grow(rid, slots):
            new_ids = self.blocks.grow(rid, slots) or []
        else:
            return Ahead.WAITS
        work = self._decode_works.get(rid) if not new_ids else None
        if work is None:
            work = ScheduledWork(request, 1, new_ids)
            if not new_ids:
                self._decode_works[rid] = work
        scheduled[rid] = work
        return Ahead.SCHEDULED

    def _schedule_one_running(self, request: Request, budget: Budget, scheduled: dict[str, ScheduledWork],
                              out: SchedulerOutput) -> None:
        n = self._chunk(request, budget)
        if n == 0:
            return
        slots = self._slots_needed(request, n, out.num_steps)
        if not self._make_room(request, slots, scheduled, budget, out):
            return
        new_ids = self.blocks.grow(request.request_id, slots) or []
        scheduled[request.request_id] = ScheduledWork(request, n, new_ids)
        budget.tokens -= n
        budget.seqs -= 1

    def _make_room(self, request: Request, slots: int, scheduled: dict[str, ScheduledWork],
                   budget: Budget, out: SchedulerOutput) -> bool:
        if self._outgrows_pool(request, slots, out):
            return False
        while not self.blocks.can_grow(request.request_id, slots):
            victim = self._pick_victim()
            if victim is None or victim is request:
                self._preempt(request, scheduled, budget, out)
                return False
            self._preempt(victim, scheduled, budget, out)
        return True

    def _outgrows_pool(self, request: Request, slots: int, out: SchedulerOutput) -> bool:
        need = self.blocks.blocks_for(slots)
        usable = self.blocks.device.num_blocks - self.blocks.watermark_blocks
        if need <= usable:
            return False
        error = (f"request grew to {slots} tokens ({need} KV blocks of {self.limits.block_size}) but the "
                 f"device pool can hold at most {usable} blocks")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self._finish(request, FinishReason.ERROR, error)
        out.rejected.append(RequestDelta(request.request_id, [], FinishReason.ERROR, error))
        return True

    def _pick_victim(self, admitted_before: int | None = None) -> Request | None:
        """The running request the victim rule picks, the one asking for room included (it then preempts
        itself, as in vLLM); requests protected by the thrash guard are never picked, nor, with
        admitted_before, requests admitted at or after that admission number."""
        inflight = self._inflight
        candidates = [r for r in self.running if not r.protected and r.request_id not in inflight
                      and (admitted_before is None or r.admitted_seq < admitted_before)]
        if not candidates:
            return None
        if self.config.policy is Policy.PRIORITY:
            return max(candidates, key=lambda r: (self._key(r), r.admitted_seq))
        if self.config.preemption_victim is Victim.LONGEST:
            return max(candidates, key=lambda r: (self.blocks.num_blocks_held(r.request_id), r.admitted_seq))
        return max(candidates, key=lambda r: r.admitted_seq)

    def _key(self, request: Request) -> float:
        return sort_key(self.config.policy, request, self.config.aging_rate)

    def _preemption_mode(self, request: Request) -> PreemptionMode:
        if request.num_computed_tokens == 0 or self.config.preemption_mode is PreemptionMode.RECOMPUTE:
            return PreemptionMode.RECOMPUTE
        if self.blocks.can_swap_out(request.request_id):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledWork], budget: Budget,
                 out: SchedulerOutput) -> None:
        work = scheduled.pop(request.request_id, None)
        if work is not None:
            budget.tokens += work.num_tokens
            budget.seqs += 1
            if not (work.is_new or work.resumed):
                self.blocks.release_tail(request.request_id, len(work.new_block_ids))
        self.running.remove(request)
        mode = self._preemption_mode(request)
        rid = request.request_id
        if mode is PreemptionMode.SWAP:
            mapping = self.blocks.swap_out(rid)
            out.swap_out.extend(mapping)
            out.swapped_out_ids.append(rid)
            self._swapped_out_blocks += len(mapping)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
        else:
            self.blocks.free(rid)
            self._forget_in_executor(rid)
            request.num_computed_tokens = 0
            self.waiting.push(request, front=True)
        self._preemptions[mode] += 1
        request.num_preemptions += 1
        request.protected = True
        out.num_preempted += 1

    def _forget_in_executor(self, request_id: str) -> None:
        if request_id in self._known_by_executor:
            self._known_by_executor.discard(request_id)
            self._to_drop.append(request_id)

    def _schedule_swapped(self, budget: Budget, scheduled: dict[str, ScheduledWork],
                          out: SchedulerOutput) -> None:
        while self.swapped and budget.seqs > 0 and budget.tokens > 0:
            request = self.swapped[0]
            n = self._chunk(request, budget)
            slots = self._slots_needed(request, n, out.num_steps)
            if self._outgrows_pool(request, slots, out):
                continue
            extra = self.blocks.blocks_for(slots) - self.blocks.num_blocks_held(request.request_id)
            if n == 0 or not self.blocks.can_swap_in(request.request_id, max(0, extra)):
                break
            self.swapped.popleft()
            mapping = self.blocks.swap_in(request.request_id)
            out.swap_in.extend(mapping)
            self._swapped_in_blocks += len(mapping)
            self._start_running(request, n, slots, scheduled, budget, resumed=True)

    def _passed_delay(self, now: float) -> bool:
        if self._prev_prompt:
            self._last_prompt_latency = now - self._prev_time
        self._prev_time, self._prev_prompt = now, False
        if self.config.scheduler_delay_factor <= 0 or not self.running:
            return True
        oldest = self.waiting.oldest()
        if oldest is None:
            return True
        return now - oldest.arrival_time > self.config.scheduler_delay_factor * self._last_prompt_latency

    def _schedule_waiting(self, budget: Budget, scheduled: dict[str, ScheduledWork], out: SchedulerOutput,
                          now: float) -> None:
        while budget.tokens > 0:
            request = self.waiting.peek(now)
            if request is None:
                break
            if self._reject_if_never(request, out):
                continue
            n = self._chunk(request, budget)
            if n == 0:
                break
            # Blocks for every known token (the whole prompt, plus output kept over a recompute), not
            # just this chunk: a prefill then never grows, so two chunked prefills can never starve each
            # other of blocks (each preempting itself, forever) -- and LATER means the prompt can't fit now.
            slots = self._slots_needed(request, request.num_tokens - request.num_computed_tokens, 1)
            fits = budget.seqs > 0 and self.blocks.can_allocate(request.num_tokens, slots) is AllocStatus.OK
            if not fits and not self._preempt_for(request, slots, scheduled, budget, out):
                break
            self._admit(request, n, slots, scheduled, budget)
            self._prev_prompt = True

    def _reject_if_never(self, request: Request, out: SchedulerOutput) -> bool:
        error = self._never_reason(request)
        if not error:
            return False
        self._finish(request, FinishReason.ERROR, error)
        out.rejected.append(RequestDelta(request.request_id, [], FinishReason.ERROR, error))
        return True

    def _never_reason(self, request: Request) -> str:
        n = request.num_tokens
        if n > self.limits.max_model_len:
            return f"request needs {n} tokens but max_model_len is {self.limits.max_model_len}"
        slots = n + self.config.num_lookahead_slots
        if self.blocks.can_allocate(slots, 0) is AllocStatus.NEVER:
            usable = self.blocks.device.num_blocks - self.blocks.watermark_blocks
            return (f"request needs {self.blocks.blocks_for(slots)} KV blocks of {self.limits.block_size} tokens "
                    f"but the device pool can hold at most {usable} blocks")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            return (f"prompt of {n} tokens exceeds max_num_batched_tokens "
                    f"{self.config.max_num_batched_tokens} with chunked prefill off")
        return ""

    def _preempt_for(self, request: Request, slots: int, scheduled: dict[str, ScheduledWork], budget: Budget,
                     out: SchedulerOutput) -> bool:
        if self.config.policy is not Policy.PRIORITY:
            return False
        while budget.seqs <= 0 or self.blocks.can_allocate(request.num_tokens, slots) is not AllocStatus.OK:
            # Never a request admitted this step: the queue just put it ahead of this one (max wait).
            victim = self._pick_victim(admitted_before=self._step_first_admission)
            if victim is None or self._key(victim) <= self._key(request):
                return False
            self._preempt(victim, scheduled, budget, out)
        return True

    def _admit(self, request: Request, n: int, slots: int, scheduled: dict[str, ScheduledWork],
               budget: Budget) -> None:
        self.waiting.discard(request)
        request.admitted_seq = self._admissions
        self._admissions += 1
        self._start_running(request, n, slots, scheduled, budget, is_new=True)

    def _start_running(self, request: Request, n: int, slots: int, scheduled: dict[str, ScheduledWork],
                       budget: Budget, is_new: bool = False, resumed: bool = False) -> None:
        """A request enters RUNNING this step: it is sent with its whole block table."""
        self.blocks.grow(request.request_id, slots)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        table = list(self.blocks.block_table(request.request_id))
        work = scheduled[request.request_id] = ScheduledWork(request, n, table, is_new=is_new, resumed=resumed)
        self._entered.append(work)
        budget.tokens -= n
        budget.seqs -= 1

    # ---- update --------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: ExecutorResult) -> list[RequestDelta]:
        """Apply a step's result; steps are updated in the order they were scheduled."""
        for i, pending in enumerate(self._unupdated):
            if pending is out:
                del self._unupdated[i]
                break
        deltas = list(out.rejected)
        append = deltas.append
        sampled, errors, logprobs = result.sampled, result.errors, result.logprobs
        max_model_len, eos_ids = self.limits.max_model_len, self.limits.eos_token_ids
        running_status = RequestStatus.RUNNING
        delta_type = RequestDelta
        plain = not logprobs and not errors
        for work in out.scheduled:
            request = work.request
            if request.status is not running_status:
                continue
            rid = request.request_id
            output = request.output_token_ids
            num_tokens = len(request.prompt_token_ids) + len(output)
            computed = request.num_computed_tokens + work.num_tokens
            tokens = sampled.get(rid)
            # Fast path, the same outcome as _apply: one token for a completed step, no error, no logprobs.
            if not plain or computed < num_tokens or tokens is None or len(tokens) != 1:
                delta = self._apply(request, work.num_tokens, result)
                if delta is not None:
                    append(delta)
                continue
            request.num_computed_tokens = computed
            token = tokens[0]
            output.append(token)
            reason = stop_reason(request.sampling, token, len(output), num_tokens + 1, max_model_len, eos_ids)
            if reason is not None:
                self._finish(request, reason)
            request.protected = False
            append(delta_type(rid, [token], reason, "", []))
        self._compact_running()
        return deltas

    def _apply(self, request: Request, num_tokens: int, result: ExecutorResult) -> RequestDelta | None:
        rid = request.request_id
        error = result.errors.get(rid)
        if error is None and request.num_computed_tokens + num_tokens >= request.num_tokens \
                and not result.sampled.get(rid):
            error = "executor returned no token for a completed step"
        if error is not None:
            self._finish(request, FinishReason.ERROR, error)
            return RequestDelta(rid, [], FinishReason.ERROR, error)
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens < request.num_tokens:
            return None
        new: list[int] = []
        reason = None
        for i, token in enumerate(result.sampled[rid]):
            if i > 0:
                request.num_computed_tokens += 1
            request.output_token_ids.append(token)
            new.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason)
                break
        request.protected = False
        logprobs = result.logprobs.get(rid, [])[:len(new)]
        return RequestDelta(rid, new, reason, logprobs=logprobs)

    def _stop_reason(self, request: Request, token: int) -> FinishReason | None:
        return stop_reason(request.sampling, token, request.num_output_tokens, request.num_tokens,
                           self.limits.max_model_len, self.limits.eos_token_ids)

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        """Finish a request for a reason found outside the core (e.g. a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, error)
            self._compact_running()

    def _finish(self, request: Request, reason: FinishReason, error: str = "") -> None:
        if request.status is RequestStatus.WAITING:
            self.waiting.discard(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self._running_dirty = True
        self.blocks.free(request.request_id)
        self._forget_in_executor(request.request_id)
        self._decode_works.pop(request.request_id, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.requests.pop(request.request_id, None)

    def _compact_running(self) -> None:
        # Only _finish takes a request out of RUNNING without removing it from the list; it marks it.
        if self._running_dirty:
            self._running_dirty = False
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
