"""Continuous batching over paged KV blocks: schedule() then update(), once per step.

Every request takes one path through each phase; the KV-cache manager decides about blocks and the
scheduler's own maps (admission order, thrash guard, held n > 1 siblings) decide about requests. The
step's plain decodes are taken as rows of the running set's columns (decode_rows.py); what ends a
request is the stop table (stop_rules.py), read by both the per-request path and those rows.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import compress

import numpy as np

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.decode_rows import NO_PLAIN, PlainDecodes, append_tokens, count_in_flight, plain_tokens
from scheduler_service.core.kv_cache_manager import AllocStatus, KVCacheManager, PrefixHit
from scheduler_service.core.outputs import (
    ExecutorResult,
    PlainRows,
    RequestDelta,
    ScheduledWork,
    SchedulerOutput,
    StepDeltas,
)
from scheduler_service.core.policy import Policy, WaitingQueue, sort_key
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.running import RunningSet
from scheduler_service.core.spec_cost import Probe, StepCosts
from scheduler_service.core.speculative import (
    DraftRecord,
    SpecDecodeStats,
    SpecMethod,
    SpeculativeConfig,
    propose_ngram,
)
from scheduler_service.core.stop_rules import StopTable, stop_reason
from scheduler_service.core.window_groups import WindowBlocks

RUNNING = RequestStatus.RUNNING


class Ahead(enum.Enum):
    SCHEDULED = "scheduled"
    WAITS = "waits"
    ENDS = "ends"


@dataclass(slots=True)
class Budget:
    tokens: int
    seqs: int
    short_of_room: bool = False
    """A running request waits for room this step (_make_room): as after a preemption, nothing swaps in or is
    admitted."""


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
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    device_blocks_cached: int = 0
    spec: SpecDecodeStats | None = None


class Scheduler:
    def __init__(self, config: CoreConfig, limits: ExecutorLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.limits = limits
        self.clock = clock
        self.kv = self._new_kv(limits)
        self.waiting = WaitingQueue(config.policy, config.aging_rate, config.max_waiting_time)
        self.rs = RunningSet(StopTable(limits))
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self._admitted: dict[str, int] = {}
        self._thrash_guarded: set[str] = set()
        self._held: dict[str, list[Request]] = {}
        self._plain = NO_PLAIN  # this step's plain decodes while schedule() runs
        self._known_by_executor: set[str] = set()
        self._to_drop: list[str] = []
        self._entered_running: list[ScheduledWork] = []
        self._step_id = 0
        self._admissions = 0
        self._step_first_admission = 0
        self._prev_time = 0.0
        self._prev_prompt = False
        self._last_prompt_latency = 0.0
        self._preemptions = {PreemptionMode.SWAP: 0, PreemptionMode.RECOMPUTE: 0}
        self._swapped_in_blocks = 0
        self._swapped_out_blocks = 0
        self._unupdated: list[SchedulerOutput] = []
        self._inflight: dict[str, tuple[ScheduledWork, int]] | None = None
        self._proposals: dict[str, list[int]] = {}  # this step's draft tokens, while schedule() runs
        self.spec_stats = SpecDecodeStats()
        self.spec_costs = StepCosts()  # measured costs of speculation (spec_cost.py)
        self._lone: tuple[int, float] | None = None  # a step scheduled with none in flight, and when

    @property
    def running(self) -> list[Request]:
        """The running requests in running order (a list that is replaced, never changed in place)."""
        return self.rs.requests

    def _new_kv(self, limits: ExecutorLimits) -> KVCacheManager:
        cfg = self.config
        return KVCacheManager(limits.num_device_blocks, limits.num_swap_blocks, limits.block_size,
                              cfg.watermark, cfg.enable_prefix_caching, limits.num_window_groups, limits.window,
                              cfg.max_num_batched_tokens + cfg.num_lookahead_slots + cfg.num_scheduler_steps,
                              limits.window_ring, limits.window_only)

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` for one that already ran (moved off a lost or draining executor).
        One whose share_prompt_with names a sibling still computing that prompt waits beside the
        queue until the sibling has it, then shares its blocks."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request_id {rid!r}")
        self.requests[rid] = request
        source = self.requests.get(request.share_prompt_with or "")
        if source is not None and source.num_computed_tokens < source.num_prompt_tokens:
            request.status = RequestStatus.WAITING
            self._held.setdefault(source.request_id, []).append(request)
            return
        self.waiting.push(request, front=front)

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORTED)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        kv = self.kv
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + sum(map(len, self._held.values())),
            num_swapped=len(self.swapped), device_usage=kv.device.usage(), cpu_usage=kv.cpu.usage(),
            device_blocks_used=kv.device.num_used, cpu_blocks_used=kv.cpu.num_used,
            num_preemptions_swap=self._preemptions[PreemptionMode.SWAP],
            num_preemptions_recompute=self._preemptions[PreemptionMode.RECOMPUTE],
            num_swapped_in_blocks=self._swapped_in_blocks, num_swapped_out_blocks=self._swapped_out_blocks,
            prefix_cache_queries=kv.prefix_stats.queries, prefix_cache_hits=kv.prefix_stats.hits,
            device_blocks_cached=kv.device.num_cached, spec=self.spec_stats,
        )

    def prefix_cache_hit_rate(self) -> float:
        """Percent of the prompt tokens looked up on admission that were found cached, so far."""
        stats = self.kv.prefix_stats
        return 100 * stats.hits / stats.queries if stats.queries else 0.0

    def reset_executor(self) -> None:
        """The executor lost its state (and so every cached block): running and swapped requests
        recompute from WAITING."""
        lost = sorted([*self.running, *self.swapped], key=lambda r: r.arrival_time, reverse=True)
        for request in lost:
            request.num_computed_tokens = 0
            self._admitted.pop(request.request_id, None)
            self.waiting.push(request, front=True)
        self.rs.clear()
        self.swapped.clear()
        self._known_by_executor.clear()
        self._to_drop.clear()
        self._unupdated.clear()
        self._inflight = None
        stats = self.kv.prefix_stats
        self.kv = self._new_kv(self.limits)
        self.kv.prefix_stats = stats

    def release(self, request_id: str) -> Request | None:
        """Take a WAITING request out of this scheduler, to hand it to another executor's; None if the
        request is not here or not waiting (a running request finishes where its blocks are)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING:
            return None
        self._leave_waiting(request)
        self.kv.free(request)
        self._forget_in_executor(request_id)
        self._thrash_guarded.discard(request_id)
        if request_id in self._held:
            self._release_held(request_id)
        del self.requests[request_id]
        return request

    def waiting_ids(self) -> list[str]:
        return [rid for rid, r in self.requests.items() if r.status is RequestStatus.WAITING]

    def cached_prefix_tokens(self, request: Request) -> int:
        """How many leading tokens of a request's prompt this executor's KV cache already holds for its cache
        scope (placement hint)."""
        return self.kv.cached_prefix_tokens(request)

    def set_executor_limits(self, limits: ExecutorLimits) -> None:
        """Resize to a (re)connected executor's pools; only with no request holding blocks."""
        if self.running or self.swapped:
            raise RuntimeError("set_executor_limits needs every request out of RUNNING and SWAPPED")
        self.limits = limits
        self.rs = RunningSet(StopTable(limits))
        stats = self.kv.prefix_stats
        self.kv = self._new_kv(limits)
        self.kv.prefix_stats = stats

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. With async scheduling it may run before update() of the steps before it (the
        executor is still running them): see _schedule_ahead."""
        self._inflight = None
        self._step_id += 1
        self._step_first_admission = self._admissions
        now = self.clock()
        out = SchedulerOutput(step_id=self._step_id, num_lookahead_slots=self.config.num_lookahead_slots)
        out.num_steps = self._num_steps()
        budget = Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        scheduled: dict[str, ScheduledWork] = {}
        if self.config.speculative_config is None or not self._drafts_in_flight():
            if self.config.speculative_config is not None and out.num_steps == 1:
                self._proposals = self._propose()
            self._schedule_phases(budget, scheduled, out, now)
        if out.num_steps > 1 and any(w.is_new or w.request.num_tokens - w.request.num_computed_tokens > 1
                                     for w in scheduled.values()):
            out.num_steps = 1
        if self._proposals:
            self._unpropose(scheduled)
        if self.kv.windows is not None:
            out.window = self._window_news(scheduled)
        out.copy = self.kv.end_step()
        out.plain = self._plain.rows(self.rs)
        self._plain = NO_PLAIN
        out.scheduled = out.plain.works + list(scheduled.values())
        # Only work that entered RUNNING this step can be new to the executor (this keeps it O(changes)).
        for work in self._entered_running:
            if scheduled.get(work.request.request_id) is work:
                self._known_by_executor.add(work.request.request_id)
                if work.request.first_scheduled_time is None:
                    work.request.first_scheduled_time = now
        self._entered_running.clear()
        out.finished_ids, self._to_drop = self._to_drop, []
        if self.config.speculative_config is not None and out.scheduled and not self._unupdated:
            self._lone = (out.step_id, now)
        if self.config.async_scheduling:
            self._unupdated.append(out)
            self._count_in_flight(out, 1)
        return out

    def _window_news(self, scheduled: dict[str, ScheduledWork]) -> dict[str, WindowBlocks]:
        """A hybrid model's window-group blocks the executor learns of this step: whole tables of the requests
        new to it or resumed, the blocks appended to the others'."""
        windows = self.kv.windows
        assert windows is not None
        news: dict[str, WindowBlocks] = {}
        for rid in windows.grown:
            found = windows.news(rid, whole=False)
            if found is not None:
                news[rid] = found
        for work in self._entered_running:
            rid = work.request.request_id
            if scheduled.get(rid) is work:
                found = windows.news(rid, whole=True)
                if found is not None:
                    news[rid] = found
        return news

    def _schedule_phases(self, budget: Budget, scheduled: dict[str, ScheduledWork], out: SchedulerOutput,
                         now: float) -> None:
        self._schedule_running(budget, scheduled, out)
        held_back = out.num_preempted > 0 or budget.short_of_room
        if not held_back:
            self._schedule_swapped(budget, scheduled, out)
        if not held_back and not self.swapped and self._passed_delay(now):
            self._schedule_waiting(budget, scheduled, out, now)

    def _drafts_in_flight(self) -> bool:
        """Async scheduling: a step with drafts is still running. The step after it waits for its answer (it is
        empty): every request then knows its tokens and may draft again, and all of them step together (a
        request that waited alone would fall out of step with the batch and halve it)."""
        return any(w.num_drafts for out in self._unupdated for w in out.explicit_works())

    def _count_in_flight(self, out: SchedulerOutput, change: int) -> None:
        """Async scheduling: each running request's number of steps scheduled but not yet updated."""
        inflight = self.rs.inflight
        count_in_flight(self.rs, out.plain, change)
        for work in out.explicit_works():
            if work.request.status is RUNNING:
                inflight[work.request.slot] += change

    def _works_in_flight(self) -> dict[str, tuple[ScheduledWork, int]]:
        """Per request with steps not yet updated: its first such work and how many steps it is in
        (built once per step, when a request with a step in flight needs more than a plain decode)."""
        if self._inflight is not None:
            return self._inflight
        if not self._unupdated:
            self._inflight = {}
            return self._inflight
        first, *later = self._unupdated
        inflight = {w.request.request_id: (w, 1) for w in first.scheduled if w.request.status is RUNNING}
        for out in later:
            for w in out.scheduled:
                if w.request.status is not RUNNING:  # a finished request's id may already name a new one
                    continue
                rid = w.request.request_id
                known = inflight.get(rid)
                inflight[rid] = (w, 1) if known is None else (known[0], known[1] + 1)
        self._inflight = inflight
        return inflight

    def _num_steps(self) -> int:
        k = self.config.num_scheduler_steps
        if k > 1 and not self._unupdated and all(r.num_tokens - r.num_computed_tokens == 1 for r in self.running):
            return k
        return 1

    def _chunk(self, remaining: int, budget_tokens: int) -> int:
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget_tokens else 0
        n = min(remaining, budget_tokens)
        if self.config.long_prefill_token_threshold > 0 and remaining > 1:
            n = min(n, self.config.long_prefill_token_threshold)
        return n

    def _schedule_running(self, budget: Budget, scheduled: dict[str, ScheduledWork], out: SchedulerOutput) -> None:
        """Running requests in running order until the token budget runs out. A plain decode (one token,
        the steps in flight before it, if any, plain decodes too, and surely not its last) needs nothing
        but a place in the budget and, when it fills its blocks, a new one: runs of them are taken whole
        (the step's PlainDecodes, a mask over the running order); every other request takes _schedule_one."""
        extra = out.num_steps - 1 + self.config.num_lookahead_slots
        plain = self._plain = PlainDecodes.choose(self.rs, self.kv, self._grow, out.num_steps, extra)
        requests = plain.order.requests
        budget_left = [budget.tokens, 0]  # tokens, and requests that wait for their step in flight
        start = 0
        for p in plain.unchosen():
            budget_left[0] = plain.take(start, p, budget_left[0])
            plain.taken = start = p + 1
            if budget_left[0] <= 0:
                plain.chosen[p:] = False
                break
            request = requests[p]
            if request.status is RUNNING:
                self._schedule_one(request, extra, budget_left, budget, scheduled, out)
        else:
            budget_left[0] = plain.take(start, len(requests), budget_left[0])
        plain.taken = len(requests)
        plain.ungrow_unchosen(self.rs, self.kv)
        budget.tokens = budget_left[0]
        # the first phase: only running work so far (and requests that wait for their step in flight)
        budget.seqs = self.config.max_num_seqs - plain.count() - len(scheduled) - budget_left[1]

    def _schedule_one(self, request: Request, extra: int, budget_left: list[int], budget: Budget,
                      scheduled: dict[str, ScheduledWork], out: SchedulerOutput) -> None:
        rid = request.request_id
        if self.rs.inflight[request.slot]:
            if self.rs.drafting[request.slot]:  # its step with drafts, or the one it drafts after, is in flight
                budget_left[1] += 1
                return
            ahead = self._schedule_ahead(request, *self._works_in_flight()[rid], out, scheduled)
            budget_left[0] -= ahead is Ahead.SCHEDULED
            budget_left[1] += ahead is Ahead.WAITS
            return
        drafts = self._proposals.get(rid)
        if drafts and self._schedule_drafts(request, drafts, extra, budget_left, scheduled):
            return
        computed = request.num_computed_tokens
        remaining = request.num_uncomputed_tokens
        n = 1 if remaining == 1 else self._chunk(remaining, budget_left[0])
        if n == 0:
            return
        if computed + n + extra > self.kv.usable_slots:
            self._reject_outgrown(request, computed + n + extra, out)
            return
        new = self._grow(request, n, extra)
        if new is None:
            budget.tokens = budget_left[0]
            new = self._make_room(request, n, extra, scheduled, budget, out)
            budget_left[0] = budget.tokens
            if new is None:
                budget_left[1] += request.status is RUNNING  # it waits for room and keeps its place
                return
        scheduled[rid] = ScheduledWork(request, n, new)
        budget_left[0] -= n

    # ---- speculative decoding -----------------------------------------------------------

    def _propose(self) -> dict[str, list[int]]:
        """Draft tokens for the running decodes that speculate this step (none above disable_by_batch_size, where
        the measured costs say no draft can pay, nor for a request that pauses after its drafts were rejected);
        their rows are marked drafting. Which proposals go into the step is decided by their measured value
        (_choose_drafters); the n-gram proposals that do not are kept as the requests' guesses and scored when
        their tokens come. Async scheduling: a request whose last token is still being sampled (a step in flight)
        cannot be drafted for; if its known tokens predict a draft worth verifying, it waits for that step (an
        empty proposal) instead of decoding ahead, and is drafted for at the next step. A structured-output
        request does not speculate: the executor gets the mask of its next position only. Method draft_model: the
        executor's draft model proposes, so a proposal is k placeholder tokens (k slots), and a request with a
        step in flight always waits for it."""
        spec = self.config.speculative_config
        batch = len(self.running)
        if spec is None or batch > spec.disable_by_batch_size:
            return {}
        probe = self.spec_costs.probe(batch)
        model_drafts = spec.method is SpecMethod.DRAFT_MODEL
        most = self.limits.max_num_model_draft_tokens if model_drafts else self.limits.max_num_draft_tokens
        k_max = min(spec.num_speculative_tokens, most)
        if k_max < 1 or (probe is Probe.NONE and not self.spec_costs.pays_at_all(batch)):
            return {}
        candidates = self._candidates(spec, k_max, model_drafts)
        chosen = self._choose_drafters(candidates, batch, probe, k_max)
        proposals: dict[str, list[int]] = {}
        for request, drafts, ahead in candidates:
            record = request.drafts = request.drafts or DraftRecord()
            if request.request_id in chosen:
                proposals[request.request_id] = [] if ahead else drafts
                self.rs.drafting[request.slot] = True
            if not model_drafts and (ahead or request.request_id not in chosen) and record.guess is None:
                record.guess = (request.num_tokens, tuple(drafts))
        return proposals

    def _candidates(self, spec: SpeculativeConfig, k_max: int,
                    model_drafts: bool) -> list[tuple[Request, list[int], int]]:
        """The running decodes that may draft now, each with its proposal and its steps in flight."""
        rs = self.rs
        found: list[tuple[Request, list[int], int]] = []
        for request in self.running:
            slot = request.slot
            if rs.uncomputed[slot] != 1 or rs.drafting[slot] or not request.output_token_ids:
                continue
            if request.sampling.constraint is not None:  # its mask covers one position: no drafts to verify
                continue
            ahead = int(rs.inflight[slot])
            k = min(k_max, int(rs.limit[slot]) - request.num_tokens - ahead - 1)  # the last allowed is the model's
            record = request.drafts
            if record is not None:
                if record.guess is not None:
                    self._settle_guess(record, request, spec)
                    if record.guess is not None and not record.on:  # off, its last guess still open: no new one
                        continue
                k = min(k, record.draft_depth(k_max))
            if k < 1 or (record is not None and request.num_output_tokens < record.resume_at):
                continue
            if model_drafts:
                found.append((request, [0] * k, ahead))
                continue
            drafts = propose_ngram(request.all_token_ids, k + ahead, spec.prompt_lookup_min, spec.prompt_lookup_max)
            if drafts:
                found.append((request, drafts, ahead))
        return found

    def _settle_guess(self, record: DraftRecord, request: Request, spec: SpeculativeConfig) -> None:
        accepted = record.settle_guess(request.all_token_ids, request.num_output_tokens, spec.min_acceptance_rate)
        if accepted is not None:
            self.spec_costs.observe_gain(accepted)

    def _choose_drafters(self, candidates: list[tuple[Request, list[int], int]], batch: int, probe: Probe,
                         k_max: int) -> set[str]:
        """The requests whose drafts go into this step: those whose expected accepted drafts are worth their
        verification at this batch size (with hysteresis; a request that must wait for its step in flight first
        gives up that step's token), if together they pay for the turnaround a verification costs under async
        scheduling; none on a plain probe, the most promising one on a draft probe."""
        if probe is Probe.PLAIN or not candidates:
            return set()
        costs = self.spec_costs
        prior = costs.mean_gain if costs.mean_gain is not None else k_max / 2
        valued: list[tuple[float, Request, bool]] = []
        for request, drafts, ahead in candidates:
            record = request.drafts
            gain = record.gain if record is not None and record.gain is not None else prior
            gain -= 1 if ahead else 0  # it waits a step for its token in flight: that step's token is lost
            k = min(len(drafts), k_max)
            on = costs.clears(batch, gain, k, record is None or record.on)
            if record is not None:
                record.on = on
            valued.append((costs.value_s(batch, gain, k), request, on))
        if probe is Probe.DRAFTS:
            return {max(valued, key=lambda v: v[0])[1].request_id}
        chosen = [(value, request) for value, request, on in valued if on]
        turnaround = costs.turnaround_s(batch) if self.config.async_scheduling else 0.0
        if not chosen or sum(value for value, _ in chosen) <= turnaround:
            return set()
        return {request.request_id for _, request in chosen}

    def _schedule_drafts(self, request: Request, drafts: list[int], extra: int, budget_left: list[int],
                         scheduled: dict[str, ScheduledWork]) -> bool:
        """A decode with its drafts: slots for the last token and every draft (lookahead), each draft charged to
        the token budget; as many drafts as the budget and the usable pool allow. False (not drafting any more)
        where none fit or the pool is short: speculation never preempts."""
        k = min(len(drafts), budget_left[0] - 1, self.kv.usable_slots - request.num_tokens - extra)
        if k >= 1:
            new = self._grow(request, 1, extra + k)
            if new is not None:
                spec = self.config.speculative_config
                scheduled[request.request_id] = (
                    ScheduledWork(request, 1, new, num_model_drafts=k)
                    if spec is not None and spec.method is SpecMethod.DRAFT_MODEL
                    else ScheduledWork(request, 1, new, draft_token_ids=tuple(drafts[:k])))
                budget_left[0] -= 1 + k
                return True
        self.rs.drafting[request.slot] = False
        return False

    def _unpropose(self, scheduled: dict[str, ScheduledWork]) -> None:
        """Proposals that did not make it into the step (budget, preemption) stop marking their rows."""
        for rid in self._proposals:
            request = self.requests.get(rid)
            work = scheduled.get(rid)
            if request is not None and request.status is RUNNING and (work is None or not work.num_drafts):
                self.rs.drafting[request.slot] = False
        self._proposals = {}

    def _settle_drafts(self, work: ScheduledWork, tokens: list[int]) -> str:
        """A verified step's tokens against its drafts: the accepted drafts, then the model's own token. Records
        the acceptance; an error message if the executor's answer cannot be a verification of these drafts. The
        slots of rejected drafts are free again: the computed count stops at the accepted ones, so the next step
        writes those positions before anything attends to them (the blocks stay in the table, which the contract
        only grows, and are the next steps' room)."""
        request, drafts, num_drafts = work.request, work.draft_token_ids, work.num_drafts
        self.rs.drafting[request.slot] = False
        accepted = len(tokens) - 1
        if accepted > num_drafts or (not work.num_model_drafts and list(drafts[:accepted]) != tokens[:accepted]):
            return f"executor returned {len(tokens)} tokens that do not verify the {num_drafts} drafts sent"
        spec = self.config.speculative_config
        if request.drafts is None:
            request.drafts = DraftRecord()
        request.drafts.record(num_drafts, accepted, request.num_output_tokens + len(tokens),
                              spec.min_acceptance_rate if spec is not None else 0.0)
        self.spec_stats.record(num_drafts, accepted)
        self.spec_costs.observe_gain(accepted)
        return ""

    def _grow(self, request: Request, n: int, extra: int) -> list[int] | None:
        new = self.kv.allocate_slots(request, n, extra)
        if new or (new is not None and self.kv.windows is not None):  # window tables may grow alone
            self.rs.set_capacity(request, self.kv.num_slots(request.request_id))
        return new

    def _schedule_ahead(self, request: Request, inflight: ScheduledWork, num_inflight: int, out: SchedulerOutput,
                        scheduled: dict[str, ScheduledWork]) -> Ahead:
        """Async scheduling: one more decode for a request whose last step(s) the executor is still running
        (the first of them `inflight`, num_inflight in all, each after the first a one-token decode). The
        executor feeds it its own freshly sampled tokens; update() of those steps runs first. Only when
        they sample, the request surely goes on (under its row's `limit`, the stop table's length rules:
        a token past an EOS or stop is dropped by update()), and its blocks grow without preempting
        anyone. A request that waits keeps its place among max_num_seqs; one that surely ends there gives
        it up."""
        num_tokens = request.num_tokens
        computed = request.num_computed_tokens
        if out.num_steps > 1 or computed + inflight.num_tokens < num_tokens:
            return Ahead.WAITS
        total = num_tokens + num_inflight  # its tokens once the steps in flight are done
        if total >= self.rs.limit[request.slot]:  # a length rule of the stop table
            return Ahead.ENDS
        lookahead = self.config.num_lookahead_slots
        if total + lookahead > self.kv.usable_slots:
            return Ahead.WAITS  # outgrows the usable pool: _schedule_one finishes it once its steps are in
        new = self._grow(request, total - computed, lookahead)
        if new is None:
            return Ahead.WAITS
        scheduled[request.request_id] = ScheduledWork(request, 1, new)
        return Ahead.SCHEDULED

    def _make_room(self, request: Request, n: int, extra: int, scheduled: dict[str, ScheduledWork],
                   budget: Budget, out: SchedulerOutput) -> list[int] | None:
        """Preempt until the request's slots fit; its new blocks, or None if it preempted itself or waits. Where no
        request may be preempted (the others in flight or guarded, and so is this one) the oldest running request
        keeps its blocks and waits until a younger one ends or preempts itself: two chunked prefills of a hybrid
        model whose window tables grow every chunk would otherwise take turns preempting themselves forever."""
        while True:
            victim = self._pick_victim()
            if victim is None and self._is_oldest_of_several(request):
                budget.short_of_room = True
                return None
            if victim is None or victim is request:
                self._preempt(request, scheduled, budget, out)
                return None
            self._preempt(victim, scheduled, budget, out)
            new = self._grow(request, n, extra)
            if new is not None:
                return new

    def _is_oldest_of_several(self, request: Request) -> bool:
        admitted = self._admitted
        return len(self.running) > 1 and min(self.running, key=lambda r: admitted[r.request_id]) is request

    def _reject_outgrown(self, request: Request, slots: int, out: SchedulerOutput) -> None:
        error = (f"request grew to {slots} tokens ({self.kv.blocks_for(slots)} KV blocks of "
                 f"{self.limits.block_size}) but the device pool can hold at most {self.kv.usable_blocks} blocks")
        self._finish(request, FinishReason.ERROR, error)
        out.rejected.append(RequestDelta(request.request_id, [], FinishReason.ERROR, error))

    def _pick_victim(self, admitted_before: int | None = None) -> Request | None:
        """The running request the victim rule picks, the one asking for room included (it then preempts
        itself, as in vLLM); requests the thrash guard holds are never picked, nor, with
        admitted_before, requests admitted at or after that admission number."""
        admitted, guarded = self._admitted, self._thrash_guarded
        limit = admitted_before if admitted_before is not None else self._admissions
        inflight = self.rs.inflight  # a request with a step in flight is never a victim (async scheduling)
        candidates = [r for r in self.running if r.status is RUNNING and r.request_id not in guarded
                      and not inflight[r.slot] and admitted[r.request_id] < limit]
        if not candidates:
            return None
        if self.config.policy is Policy.PRIORITY:
            return max(candidates, key=lambda r: (self._key(r), admitted[r.request_id]))
        if self.config.preemption_victim is Victim.LONGEST:
            return max(candidates, key=lambda r: (self.kv.num_blocks_held(r.request_id), admitted[r.request_id]))
        return max(candidates, key=lambda r: admitted[r.request_id])

    def _key(self, request: Request) -> float:
        return sort_key(self.config.policy, request, self.config.aging_rate)

    def _preemption_mode(self, request: Request) -> PreemptionMode:
        if request.num_computed_tokens == 0 or self.config.preemption_mode is PreemptionMode.RECOMPUTE:
            return PreemptionMode.RECOMPUTE
        if self.kv.can_swap_out(request.request_id):
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE

    def _preempt(self, request: Request, scheduled: dict[str, ScheduledWork], budget: Budget,
                 out: SchedulerOutput) -> None:
        rid = request.request_id
        work = scheduled.pop(rid, None)
        if work is not None:
            budget.tokens += work.num_tokens + work.num_drafts
            budget.seqs += 1
            if not (work.is_new or work.resumed):
                self.kv.release_tail(rid, len(work.new_block_ids))
        elif self._plain.unchoose(request, self.kv):
            budget.tokens += 1
            budget.seqs += 1
        self.rs.remove(request)
        self._admitted.pop(rid, None)
        mode = self._preemption_mode(request)
        if mode is PreemptionMode.SWAP:
            mapping = self.kv.swap_out(request)
            out.swap_out.extend(mapping)
            out.swapped_out_ids.append(rid)
            self._swapped_out_blocks += len(mapping)
            request.status = RequestStatus.SWAPPED
            self.swapped.append(request)
        else:
            self.kv.free(request)
            self._forget_in_executor(rid)
            request.num_computed_tokens = 0
            self.waiting.push(request, front=True)
        self._preemptions[mode] += 1
        request.num_preemptions += 1
        self._thrash_guarded.add(rid)
        out.num_preempted += 1

    def _forget_in_executor(self, request_id: str) -> None:
        if request_id in self._known_by_executor:
            self._known_by_executor.discard(request_id)
            self._to_drop.append(request_id)

    def _schedule_swapped(self, budget: Budget, scheduled: dict[str, ScheduledWork], out: SchedulerOutput) -> None:
        kv = self.kv
        while self.swapped and budget.seqs > 0 and budget.tokens > 0:
            request = self.swapped[0]
            n = self._chunk(request.num_tokens - request.num_computed_tokens, budget.tokens)
            slots = request.num_computed_tokens + n + out.num_steps - 1 + self.config.num_lookahead_slots
            if kv.never_fits(slots):
                self._reject_outgrown(request, slots, out)
                continue
            if n == 0 or not kv.can_swap_in(request.request_id, slots):
                break
            self.swapped.popleft()
            mapping = kv.swap_in(request)
            out.swap_in.extend(mapping)
            self._swapped_in_blocks += len(mapping)
            kv.allocate_slots(request, n, slots - request.num_computed_tokens - n)
            self._start_running(request, n, scheduled, budget, resumed=True)

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
        reserved = self._window_reserve(self.running) if self.kv.windows is not None else 0
        while budget.tokens > 0:
            request = self.waiting.peek(now)
            if request is None:
                break
            if self._reject_if_never(request, out):
                continue
            hit = self._prefix_hit(request)
            n = self._chunk(request.num_tokens - hit.num_tokens, budget.tokens)
            if n == 0:
                break
            # Blocks for every known token (the whole prompt, plus output kept over a recompute), not
            # just this chunk: a prefill then never grows, so two chunked prefills can never starve each
            # other of blocks (each preempting itself, forever) -- and LATER means the prompt can't fit now.
            slots = request.num_tokens + self.config.num_lookahead_slots
            chunk_end = self._chunk_end(hit, n)
            fits = budget.seqs > 0 and self.kv.can_admit(hit, slots, chunk_end, reserved) is AllocStatus.OK
            if not fits:  # (the priority policy preempts only where the request does not fit at all)
                if not self._preempt_for(request, hit, slots, chunk_end, scheduled, budget, out):
                    break
                hit = self._prefix_hit(request)
                n = self._chunk(request.num_tokens - hit.num_tokens, budget.tokens)
                if n == 0 or self.kv.can_admit(hit, slots, self._chunk_end(hit, n)) is not AllocStatus.OK:
                    break
            self._admit(request, hit, n, slots, scheduled, budget)
            if self.kv.windows is not None:
                reserved += self._window_reserve([request])
            self._prev_prompt = True

    def _window_reserve(self, requests: list[Request]) -> int:
        """The blocks these requests' chunked prefills take for their window tables' next chunk, which a new
        request of a hybrid model must leave free: each chunk grows them, and two prefills whose growth the pool
        cannot hold would take turns preempting themselves (under async scheduling the other is in flight, never
        a victim)."""
        budget, lookahead = self.config.max_num_batched_tokens, self.config.num_lookahead_slots
        return sum(self.kv.next_window_growth(r, self._chunk(r.num_uncomputed_tokens, budget) + lookahead, lookahead)
                   for r in requests if r.num_uncomputed_tokens > 1)

    def _chunk_end(self, hit: PrefixHit, n: int) -> int:
        """The slots a new request's first step needs (its window groups' tables go that far at admission)."""
        return hit.num_tokens + n + self.config.num_lookahead_slots

    def _prefix_hit(self, request: Request) -> PrefixHit:
        cached = self.kv.get_computed_blocks(request)
        source = self.requests.get(request.share_prompt_with or "")
        if source is None or source.status is not RUNNING or request.output_token_ids or request.wants_prompt_logprobs \
                or source.num_computed_tokens < request.num_prompt_tokens \
                or any(w.request is source for w in self._entered_running):
            return cached  # (a source that entered RUNNING this step: the executor gets its blocks only now)
        forked = self.kv.fork_blocks(request, source.request_id)
        if forked is None or forked.num_tokens <= cached.num_tokens:
            return cached
        self._thrash_guarded.add(source.request_id)  # its block is this step's copy source
        return forked

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
        if self.kv.never_fits(slots):
            return (f"request needs {self.kv.blocks_for(slots)} KV blocks of {self.limits.block_size} tokens "
                    f"but the device pool can hold at most {self.kv.usable_blocks} blocks")
        if not self.config.enable_chunked_prefill and n > self.config.max_num_batched_tokens:
            return (f"prompt of {n} tokens exceeds max_num_batched_tokens "
                    f"{self.config.max_num_batched_tokens} with chunked prefill off")
        return ""

    def _preempt_for(self, request: Request, hit: PrefixHit, slots: int, chunk_end: int,
                     scheduled: dict[str, ScheduledWork], budget: Budget, out: SchedulerOutput) -> bool:
        if self.config.policy is not Policy.PRIORITY:
            return False
        while budget.seqs <= 0 or self.kv.can_admit(hit, slots, chunk_end) is not AllocStatus.OK:
            # Never a request admitted this step: the queue just put it ahead of this one (max wait).
            victim = self._pick_victim(admitted_before=self._step_first_admission)
            if victim is None or self._key(victim) <= self._key(request):
                return False
            self._preempt(victim, scheduled, budget, out)
        return True

    def _admit(self, request: Request, hit: PrefixHit, n: int, slots: int, scheduled: dict[str, ScheduledWork],
               budget: Budget) -> None:
        self.waiting.discard(request, admitted=True)
        self.kv.admit(request, hit, slots, self._chunk_end(hit, n))
        request.num_computed_tokens = hit.num_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = hit.num_tokens
        self._start_running(request, n, scheduled, budget, is_new=True)

    def _start_running(self, request: Request, n: int, scheduled: dict[str, ScheduledWork], budget: Budget,
                       is_new: bool = False, resumed: bool = False) -> None:
        """A request enters RUNNING this step: it is sent with its whole block table."""
        request.status = RUNNING
        self.rs.add(request, self.kv.num_slots(request.request_id))
        self._admitted[request.request_id] = self._admissions
        self._admissions += 1
        table = list(self.kv.block_table(request.request_id))
        work = scheduled[request.request_id] = ScheduledWork(request, n, table, is_new=is_new, resumed=resumed)
        self._entered_running.append(work)
        budget.tokens -= n
        budget.seqs -= 1

    # ---- update --------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, result: ExecutorResult) -> StepDeltas:
        """Apply a step's result; steps are updated in the order they were scheduled."""
        for i, pending in enumerate(self._unupdated):
            if pending is out:
                del self._unupdated[i]
                self._count_in_flight(out, -1)
                break
        if self.config.speculative_config is not None and result.busy_s > 0.0:
            self._observe_costs(out, result.busy_s)
        deltas = StepDeltas(list(out.rejected))
        if out.plain is not None and out.plain.ids:
            self._update_plain(out.plain, result, deltas)
        for work in out.explicit_works():
            self._update_one(work, result, deltas.others)
        return deltas

    def _observe_costs(self, out: SchedulerOutput, busy_s: float) -> None:
        """Speculation's measured costs (spec_cost.py): a decode step's time by its batch size and drafts, and a
        lone step's turnaround. Not with speculation that is not adaptive: unmeasured costs draft everywhere."""
        spec = self.config.speculative_config
        if spec is not None and not spec.adaptive:
            return
        if self._lone is not None and self._lone[0] == out.step_id:
            self.spec_costs.observe_turnaround(len(out.scheduled), self.clock() - self._lone[1], busy_s)
            self._lone = None
        if out.num_steps != 1 or out.swap_in or out.swap_out or out.copy:
            return
        explicit = out.explicit_works()
        if any(w.num_tokens != 1 or w.is_new for w in explicit):
            return
        batch = len(out.scheduled)
        self.spec_costs.observe_step(batch, sum(w.num_drafts for w in explicit), busy_s)

    def _update_plain(self, plain: PlainRows, result: ExecutorResult, deltas: StepDeltas) -> None:
        """The plain decodes in columns: each appends its token; only those a stop rule may end, or that
        sampled their first token, walk through the per-request rules."""
        tokens = plain_tokens(plain, result)
        if tokens is None:
            for work in plain.works:
                self._update_one(work, result, deltas.others)
            return
        requests, ids, tokens, check = append_tokens(self.rs, plain, tokens)
        self._completed(ids)
        if check.any():
            rs = self.rs
            for i in np.flatnonzero(check).tolist():
                request = requests[i]
                first = len(request.output_token_ids) == 1
                if first:  # the prompt's last token was computed: its blocks are registered at once
                    self.kv.cache_blocks(request)
                kept, reason = self._append_checked(request, [tokens[i]])
                if first and request.status is RUNNING:
                    rs.sync(request)
                deltas.others.append(RequestDelta(ids[i], kept, reason))
            keep = (~check).tolist()
            ids, tokens = list(compress(ids, keep)), list(compress(tokens, keep))
        deltas.ids, deltas.tokens = ids, tokens

    def _update_one(self, work: ScheduledWork, result: ExecutorResult, others: list[RequestDelta]) -> None:
        request = work.request
        if request.status is not RUNNING:
            return
        rid = request.request_id
        if result.errors and rid in result.errors:
            self._fail(request, result.errors[rid], others.append)
            return
        before = request.num_computed_tokens
        request.num_uncomputed_tokens -= work.num_tokens
        block_size = self.limits.block_size
        if before < request.num_prompt_tokens and (before + work.num_tokens) // block_size != before // block_size:
            self.kv.cache_blocks(request)  # prompt blocks at once; the others when the request leaves the device
        prompt = None
        if request.prompt_logprobs is not None:
            error, prompt = request.prompt_logprobs.collect(result.prompt_logprobs.get(rid),
                                                            request.num_computed_tokens >= request.num_prompt_tokens)
            if error:
                self._fail(request, error, others.append)
                return
        if request.num_uncomputed_tokens > 0:
            self.rs.sync(request)
            if prompt is not None:
                others.append(RequestDelta(rid, [], prompt_logprobs=prompt))
            return
        tokens = result.tokens_of(rid)
        if not tokens:
            self._fail(request, "executor returned no token for a completed step", others.append)
            return
        error = self._settle_drafts(work, tokens) if work.num_drafts else ""
        if error:
            self._fail(request, error, others.append)
            return
        self._completed([rid])
        request.output_token_ids += tokens
        request.num_uncomputed_tokens = 1
        tokens, reason = self._append_checked(request, tokens)
        if request.status is RUNNING:
            self.rs.sync(request)
        logprobs = result.logprobs.get(rid, [])[:len(tokens)] if result.logprobs else []
        others.append(RequestDelta(rid, tokens, reason, "", logprobs, prompt))

    def _completed(self, ids: list[str]) -> None:
        """These requests computed all their known tokens: the thrash guard lets them go, and their held
        n > 1 siblings may share the prompt now."""
        if self._thrash_guarded:
            self._thrash_guarded.difference_update(ids)
        if self._held:
            for rid in [rid for rid in ids if rid in self._held]:
                self._release_held(rid)

    def _append_checked(self, request: Request, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """Check the tokens just appended (and counted computed but the last) in order; keep those up to
        a stop, finishing the request there. Tokens after the first came from extra decode steps."""
        output = request.output_token_ids
        first = len(output) - len(tokens)
        num_tokens = len(request.prompt_token_ids) + first
        plans = self.rs.plans[request.slot]
        for i, token in enumerate(tokens):
            reason = stop_reason(plans, request.sampling, token, first + i + 1, num_tokens + i + 1)
            if reason is not None or i == len(tokens) - 1:
                del output[first + i + 1:]
                if reason is not None:
                    self._finish(request, reason)
                return tokens[:i + 1], reason
        return tokens, None

    def _fail(self, request: Request, error: str, append: Callable[[RequestDelta], None]) -> None:
        self._finish(request, FinishReason.ERROR, error)
        append(RequestDelta(request.request_id, [], FinishReason.ERROR, error))

    def _release_held(self, source_id: str) -> None:
        """The sibling computed the prompt (or finished): its held n > 1 siblings join the queue."""
        for request in reversed(self._held.pop(source_id, [])):
            self.waiting.push(request, front=True)

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        """Finish a request for a reason found outside the core (e.g. a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, error)

    def _finish(self, request: Request, reason: FinishReason, error: str = "") -> None:
        rid = request.request_id
        if request.status is RequestStatus.WAITING:
            self._leave_waiting(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request.status is RUNNING:
            self.rs.remove(request)
        self.kv.free(request)
        self._forget_in_executor(rid)
        self._admitted.pop(rid, None)
        self._thrash_guarded.discard(rid)
        if rid in self._held:
            self._release_held(rid)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error = error
        self.requests.pop(rid, None)

    def _leave_waiting(self, request: Request) -> None:
        siblings = self._held.get(request.share_prompt_with or "")
        if siblings is not None and request in siblings:
            siblings.remove(request)
            return
        self.waiting.discard(request)
