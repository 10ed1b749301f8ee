"""Targeted tests of the scheduler core's policies: queue order, aging, victims, preemption modes,
admission rules, delay factor, lookahead, multi-step and chunked prefill."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.kv_cache_manager import AllocStatus, KVCacheManager, PrefixHit
from scheduler_service.core.outputs import ExecutorResult, RequestDelta, SchedulerOutput
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import FakeClock, make_request
from tests.support.model_executor import ModelExecutor, token_at

EOS = 2


class Harness:
    """A scheduler driven by the KV-checking executor model; collects every request's tokens."""

    def __init__(self, num_blocks: int = 64, cpu_blocks: int = 0, block_size: int = 16,
                 max_model_len: int = 4096, **config: object) -> None:
        self.clock = FakeClock()
        cfg = CoreConfig(watermark=0.0, **config)  # type: ignore[arg-type]
        limits = ExecutorLimits(block_size=block_size, num_device_blocks=num_blocks, num_swap_blocks=cpu_blocks,
                             max_model_len=max_model_len, eos_token_ids=(EOS,))
        self.s = Scheduler(cfg, limits, clock=self.clock)
        self.ex = ModelExecutor(num_blocks, max(cpu_blocks, 1), block_size)
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, FinishReason] = {}
        self.errors: dict[str, str] = {}

    def add(self, rid: str, prompt_len: int, max_tokens: int = 1000, hint: int | None = None,
            **sampling: object) -> Request:
        sampling.setdefault("ignore_eos", True)
        request = make_request(rid, prompt_len, max_tokens=max_tokens, arrival=self.clock.now, **sampling)
        request.output_len_hint = hint
        self.s.add_request(request)
        self.tokens[rid] = []
        return request

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.record(self.s.update(out, self.ex.step(out)))
        return out

    def record(self, deltas: Iterable[RequestDelta]) -> None:
        for d in deltas:
            self.tokens[d.request_id] += d.new_token_ids
            if d.finish_reason is not None:
                self.reasons[d.request_id] = d.finish_reason
                self.errors[d.request_id] = d.error

    def run_to_end(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return
            self.step()
        raise AssertionError(f"still unfinished: {list(self.s.requests)}")

    def running_ids(self) -> list[str]:
        return [r.request_id for r in self.s.running]


def ids(out: SchedulerOutput) -> list[str]:
    return [w.request.request_id for w in out.scheduled]


def composition(out: SchedulerOutput) -> dict[str, int]:
    return {w.request.request_id: w.num_tokens for w in out.scheduled}


def expected_tokens(rid: str, prompt_len: int, n: int) -> list[int]:
    """What the executor model samples for rid when nothing stops it early."""
    return [token_at(rid, prompt_len + i) for i in range(n)]


# ---- queue order ------------------------------------------------------------------------------


def admission_order(policy: Policy, specs: list[tuple[str, float, dict[str, Any]]],
                    now: float | None = None, **config: Any) -> list[str]:
    """Admit one request per step (max_num_seqs=1, max_tokens=1) and return the order they ran in."""
    h = Harness(max_num_seqs=1, policy=policy, **config)
    for rid, arrival, sampling in specs:
        hint = sampling.pop("hint", None)
        request = make_request(rid, 8, arrival=arrival, **{"max_tokens": 1, **sampling})
        request.output_len_hint = hint
        h.s.add_request(request)
    h.clock.now = now if now is not None else max(a for _, a, _ in specs)
    order: list[str] = []
    while h.s.has_unfinished():
        out = h.s.schedule()
        assert len(out.scheduled) == 1
        order += ids(out)
        h.s.update(out, h.ex.step(out))
    return order


def test_fcfs_serves_in_arrival_order() -> None:
    specs: list[tuple[str, float, dict[str, object]]] = [
        ("a", 0.0, {"priority": 9}), ("b", 1.0, {"priority": 0}), ("c", 2.0, {"priority": 5})]
    assert admission_order(Policy.FCFS, specs) == ["a", "b", "c"]


def test_sjf_serves_shortest_remaining_output_first_using_hints() -> None:
    # admission_order forces max_tokens=1 for quick finishing, so give sjf its lengths through hints.
    specs: list[tuple[str, float, dict[str, object]]] = [
        ("long", 0.0, {"hint": 500}), ("short", 1.0, {"hint": 5}), ("mid", 2.0, {"hint": 50}),
        ("tie-early", 0.5, {"hint": 50})]
    assert admission_order(Policy.SJF, specs) == ["short", "tie-early", "mid", "long"]


def test_sjf_uses_max_tokens_without_a_hint_and_the_hint_over_max_tokens() -> None:
    h = Harness(policy=Policy.SJF)
    h.add("big", 8, max_tokens=300)
    h.add("small", 8, max_tokens=10)
    hinted = h.add("hinted", 8, max_tokens=1000, hint=3)
    assert ids(h.step()) == ["hinted", "small", "big"]
    assert hinted.remaining_output == 2


def test_sjf_queue_key_is_remaining_output() -> None:
    r = make_request("r", 4, max_tokens=100)
    r.output_token_ids += [5] * 30
    assert r.remaining_output == 70
    r.output_len_hint = 40
    assert r.remaining_output == 10
    r.output_len_hint = 20
    assert r.remaining_output == 0


def test_priority_lower_value_first_ties_by_arrival() -> None:
    # Pushed out of arrival order: ties must still go by arrival time, not by push order.
    specs: list[tuple[str, float, dict[str, object]]] = [
        ("p3", 0.0, {"priority": 3}), ("p1-late", 3.0, {"priority": 1}), ("p2", 1.0, {"priority": 2}),
        ("p1-early", 2.0, {"priority": 1})]
    assert admission_order(Policy.PRIORITY, specs) == ["p1-early", "p1-late", "p2", "p3"]


def test_aging_lets_an_old_low_priority_request_overtake() -> None:
    specs: list[tuple[str, float, dict[str, object]]] = [
        ("old-low", 0.0, {"priority": 10}), ("new-high", 20.0, {"priority": 0})]
    assert admission_order(Policy.PRIORITY, specs, now=20.5) == ["new-high", "old-low"]
    # Effective priority = base - rate * waited: old-low is 10 - 20.5 = -10.5, new-high is -0.5.
    assert admission_order(Policy.PRIORITY, specs, now=20.5, aging_rate=1.0) == ["old-low", "new-high"]
    # Too little aging to make up 10 priority units over 20 s.
    assert admission_order(Policy.PRIORITY, specs, now=20.5, aging_rate=0.4) == ["new-high", "old-low"]


def test_aging_applies_to_sjf() -> None:
    specs: list[tuple[str, float, dict[str, object]]] = [("old-long", 0.0, {"hint": 100}),
                                                         ("new-short", 50.0, {"hint": 10})]
    assert admission_order(Policy.SJF, specs, now=50.0) == ["new-short", "old-long"]
    assert admission_order(Policy.SJF, specs, now=50.0, aging_rate=2.0) == ["old-long", "new-short"]


@pytest.mark.parametrize("policy", [Policy.PRIORITY, Policy.SJF])
def test_max_waiting_time_sends_the_oldest_to_the_head(policy: Policy) -> None:
    h = Harness(max_num_seqs=1, policy=policy, max_waiting_time=5.0)
    h.add("starving", 8, max_tokens=1, priority=9, hint=900)
    h.clock.now = 1.0
    h.add("fresh1", 8, max_tokens=1, priority=0)
    h.add("fresh2", 8, max_tokens=1, priority=0)
    h.clock.now = 4.0  # starving has waited 4 s <= 5 s: the policy's order holds
    assert ids(h.step()) == ["fresh1"]
    h.clock.now = 5.5  # now 5.5 s > 5 s: it goes first although fresh2 is better by the policy
    assert ids(h.step()) == ["starving"]
    assert ids(h.step()) == ["fresh2"]


# ---- victims and preemption modes -------------------------------------------------------------
# Tiny pools of 4-token blocks; max_tokens keeps every request within what the pool can hold.


def preempted_in(h: Harness, before: list[str]) -> list[str]:
    """Requests running before the step and neither running nor finished after it."""
    return [rid for rid in before if rid not in h.running_ids() and rid not in h.reasons]


@pytest.mark.parametrize(("victim", "expected"), [(Victim.LATEST, "c"), (Victim.LONGEST, "b")])
def test_victim_flag_picks_latest_or_longest(victim: Victim, expected: str) -> None:
    # 4 device blocks: a holds 1 (4 tokens: it grows next step), b holds 2 (7 tokens), c holds 1 (3 tokens).
    h = Harness(num_blocks=4, block_size=4, preemption_victim=victim)
    for rid, n in [("a", 4), ("b", 7), ("c", 3)]:
        h.add(rid, n, max_tokens=8)
    assert ids(h.step()) == ["a", "b", "c"]
    assert h.s.kv.device.num_free == 0
    before = h.running_ids()
    out = h.step()  # a needs a second block: exactly one victim makes room
    assert out.num_preempted == 1
    assert preempted_in(h, before) == [expected]
    assert "a" in ids(out) and expected not in ids(out)
    assert h.s.requests[expected].status is RequestStatus.WAITING  # no swap pool: recompute
    h.run_to_end()
    for rid, n in [("a", 4), ("b", 7), ("c", 3)]:
        assert h.tokens[rid] == expected_tokens(rid, n, 8)


def test_priority_policy_victim_is_worst_effective_priority_not_latest() -> None:
    h = Harness(num_blocks=3, block_size=4, policy=Policy.PRIORITY, preemption_victim=Victim.LATEST)
    h.add("x", 3, max_tokens=6, priority=5)
    h.add("a", 3, max_tokens=6, priority=0)
    assert ids(h.step()) == ["a", "x"]
    h.add("c", 3, max_tokens=6, priority=1)  # admitted last: the latest, but not the worst priority
    assert ids(h.step()) == ["a", "x", "c"]
    out = h.step()  # a and x both need a second block; the pool is full: x goes
    assert out.num_preempted == 1
    assert composition(out) == {"a": 1, "c": 1}
    assert h.s.requests["x"].status is RequestStatus.WAITING
    h.run_to_end()
    assert h.tokens["x"] == expected_tokens("x", 3, 6)


@pytest.mark.parametrize("policy", [Policy.FCFS, Policy.PRIORITY])
def test_a_request_that_is_itself_the_victim_preempts_itself(policy: Policy) -> None:
    # b is both the latest admitted and the worst priority: when it cannot grow it goes, not a.
    h = Harness(num_blocks=2, block_size=4, policy=policy)
    h.add("a", 3, max_tokens=5, priority=0)
    h.add("b", 4, max_tokens=4, priority=5)
    h.step()
    out = h.step()
    assert out.num_preempted == 1
    assert composition(out) == {"a": 1}
    assert h.running_ids() == ["a"]
    assert h.s.requests["b"].status is RequestStatus.WAITING
    h.run_to_end()
    assert h.tokens["a"] == expected_tokens("a", 3, 5)
    assert h.tokens["b"] == expected_tokens("b", 4, 4)


def test_thrash_guard_a_resumed_request_is_not_a_victim_before_a_new_token() -> None:
    # c is preempted (it is the latest), then readmitted: the latest again, and protected while its
    # recompute prefill runs in 1-token chunks (threshold 1). When b needs room meanwhile, the latest
    # unprotected request goes -- b itself -- not c.
    h = Harness(num_blocks=6, block_size=4, long_prefill_token_threshold=1)
    for rid, n in [("a", 4), ("b", 6), ("c", 4)]:
        h.add(rid, n, max_tokens=8)
    c = h.s.requests["c"]
    first: list[str] = []
    while not first:
        before = h.running_ids()
        h.step()
        first = preempted_in(h, before)
    assert first == ["c"]
    assert "c" in h.s._thrash_guarded and c.num_preemptions == 1
    guarded_steps = 0
    while "c" in h.s._thrash_guarded:
        running_guarded = c.status is RequestStatus.RUNNING
        latest = max(h.s.running, key=lambda r: h.s._admitted[r.request_id]) if h.s.running else None
        before = h.running_ids()
        h.step()
        victims = preempted_in(h, before)
        if running_guarded and victims:
            assert latest is c and victims == ["b"]
            guarded_steps += 1
    assert guarded_steps == 1, "the scenario no longer exercises the guard"
    assert c.num_preemptions == 1 and c.num_output_tokens > 1
    h.run_to_end()
    for rid, n in [("a", 4), ("b", 6), ("c", 4)]:
        assert h.tokens[rid] == expected_tokens(rid, n, 8)


def test_thrash_guard_flag_set_on_preemption_and_cleared_by_a_new_token() -> None:
    h = Harness(num_blocks=2, block_size=4)
    h.add("a", 3, max_tokens=5)
    h.add("b", 4, max_tokens=4)
    h.step()
    h.step()  # b preempts itself (recompute)
    b = h.s.requests["b"]
    assert "b" in h.s._thrash_guarded and b.status is RequestStatus.WAITING
    n = len(h.tokens["b"])
    while len(h.tokens["b"]) == n:
        assert "b" in h.s._thrash_guarded
        h.step()
    assert "b" not in h.s._thrash_guarded


def swap_setup(mode: PreemptionMode, cpu_blocks: int) -> tuple[Harness, SchedulerOutput]:
    """a (2 blocks), b (2 blocks), c (1 block) fill 5 device blocks of 4 and all need one more block in
    step 2: a preempts c (the latest), then b, now the latest itself, preempts itself."""
    h = Harness(num_blocks=5, cpu_blocks=cpu_blocks, block_size=4, preemption_mode=mode)
    h.add("a", 8, max_tokens=6)
    h.add("b", 8, max_tokens=8)
    h.add("c", 4, max_tokens=8)
    h.step()
    return h, h.step()


def assert_all_tokens(h: Harness) -> None:
    assert h.tokens == {"a": expected_tokens("a", 8, 6), "b": expected_tokens("b", 8, 8),
                        "c": expected_tokens("c", 4, 8)}


@pytest.mark.parametrize("mode", [PreemptionMode.AUTO, PreemptionMode.SWAP])
def test_full_cpu_pool_falls_back_to_recompute_never_raises(mode: PreemptionMode) -> None:
    h, out = swap_setup(mode, cpu_blocks=1)
    # c's one block fits the one CPU block; b, the next victim, finds the CPU pool full.
    assert out.swapped_out_ids == ["c"] and len(out.swap_out) == 1
    assert [r.request_id for r in h.s.swapped] == ["c"]
    assert h.s.requests["b"].status is RequestStatus.WAITING
    assert h.s.requests["b"].num_computed_tokens == 0 and h.s.requests["b"].num_output_tokens == 1
    stats = h.s.stats()
    assert (stats.num_preemptions_swap, stats.num_preemptions_recompute) == (1, 1)
    assert h.s.kv.cpu.num_free == 0
    h.run_to_end()
    assert_all_tokens(h)


def test_auto_swaps_while_the_cpu_pool_has_room() -> None:
    h, out = swap_setup(PreemptionMode.AUTO, cpu_blocks=16)
    assert out.swapped_out_ids == ["c", "b"] and len(out.swap_out) == 3
    h.run_to_end()
    assert h.s.stats().num_preemptions_recompute == 0
    assert h.s.stats().num_preemptions_swap >= 2
    assert_all_tokens(h)


def test_recompute_mode_never_swaps() -> None:
    h, out = swap_setup(PreemptionMode.RECOMPUTE, cpu_blocks=16)
    assert out.num_preempted == 2 and not out.swap_out and not h.s.swapped
    # Recomputed requests keep their generated tokens and rejoin the front of WAITING.
    assert [h.s.requests[r].num_output_tokens for r in "bc"] == [1, 1]
    assert [h.s.requests[r].num_computed_tokens for r in "bc"] == [0, 0]
    assert h.s.waiting.peek(h.clock.now) is h.s.requests["b"]
    h.add("late", 2, max_tokens=2)
    order = [w.request.request_id for _ in range(40) for w in h.step().scheduled if w.is_new]
    assert order.index("b") < order.index("c") < order.index("late")
    h.run_to_end()
    assert h.s.stats().num_preemptions_swap == 0
    h.tokens.pop("late")
    assert_all_tokens(h)


def test_swapped_come_back_in_swap_out_order_before_any_new_admission() -> None:
    h, out = swap_setup(PreemptionMode.SWAP, cpu_blocks=16)
    assert out.swapped_out_ids == ["c", "b"]
    h.add("new", 2, max_tokens=5)  # a tiny newcomer: one block
    resumed_all: list[str] = []
    blocked_with_room = 0
    while h.s.requests["new"].status is RequestStatus.WAITING:
        queue_before = [r.request_id for r in h.s.swapped]
        free_before = h.s.kv.device.num_free
        out = h.step()
        resumed = [w.request.request_id for w in out.scheduled if w.resumed]
        assert resumed == queue_before[:len(resumed)], "swap-in is not oldest-swapped first"
        resumed_all += resumed
        new = [w for w in out.scheduled if w.is_new]
        if new:
            assert not h.s.swapped and out.scheduled.index(new[0]) > max(
                (i for i, w in enumerate(out.scheduled) if w.resumed), default=-1)
        elif queue_before and free_before >= 2 and not out.num_preempted:
            blocked_with_room += 1  # room for the newcomer, but a request is still swapped out
    assert resumed_all[:2] == ["c", "b"]
    assert blocked_with_room >= 1
    assert not h.s.swapped
    h.run_to_end()
    assert h.tokens["new"] == expected_tokens("new", 2, 5)
    h.tokens.pop("new")
    assert_all_tokens(h)


# ---- admission ---------------------------------------------------------------------------------


def test_a_step_that_preempted_admits_nothing_new() -> None:
    # a and x run; a's growth preempts x (worst priority, recompute) and frees a block that c could use.
    h = Harness(num_blocks=3, block_size=4, policy=Policy.PRIORITY)
    h.add("a", 4, max_tokens=4, priority=0)
    h.add("x", 7, max_tokens=4, priority=5)
    h.step()
    h.add("c", 2, max_tokens=2, priority=1)  # arrives when the pool is full
    out = h.step()
    assert out.num_preempted == 1 and h.s.requests["x"].status is RequestStatus.WAITING
    assert h.s.kv.device.num_free >= 1  # c (one block) would fit...
    assert ids(out) == ["a"]  # ...but this step preempted, so nothing new
    assert ids(h.step()) == ["a", "c"]  # the next step admits it (c beats x on priority)


def test_kv_cache_manager_admission_ok_later_never_with_watermark() -> None:
    kv = KVCacheManager(num_device_blocks=10, num_swap_blocks=0, block_size=16, watermark=0.1)
    assert kv.watermark_blocks == 1
    assert kv.can_admit(PrefixHit(), 9 * 16) is AllocStatus.OK
    assert kv.never_fits(9 * 16 + 1) and not kv.never_fits(9 * 16)  # 10 blocks > 10 - watermark
    r = make_request("r", 5 * 16)
    kv.admit(r, PrefixHit(), 5 * 16)
    assert kv.can_admit(PrefixHit(), 4 * 16) is AllocStatus.OK  # 5 free - 4 = 1 = watermark
    assert kv.can_admit(PrefixHit(), 5 * 16) is AllocStatus.LATER  # would eat into the watermark
    kv.free(r)
    assert kv.can_admit(PrefixHit(), 5 * 16) is AllocStatus.OK


def test_never_finishes_at_once_naming_both_sizes_and_the_queue_proceeds() -> None:
    h = Harness(num_blocks=8, max_num_seqs=4)
    h.add("first", 16, max_tokens=2)
    h.add("huge", 200, max_tokens=4)  # 13 blocks of 16 > 8
    h.add("behind", 16, max_tokens=2)
    out = h.step()
    assert [d.request_id for d in out.rejected] == ["huge"]
    error = h.errors["huge"]
    assert h.reasons["huge"] is FinishReason.ERROR
    assert "13 KV blocks of 16 tokens" in error and "at most 8 blocks" in error
    assert ids(out) == ["first", "behind"]
    assert "huge" not in h.s.requests
    h.run_to_end()
    assert h.tokens["first"] == expected_tokens("first", 16, 2)
    assert h.tokens["behind"] == expected_tokens("behind", 16, 2)


def test_later_stops_admission_no_skipping_ahead_under_fcfs() -> None:
    h = Harness(num_blocks=8)
    h.add("runner", 65, max_tokens=3)  # 5 of 8 blocks
    h.step()
    h.add("big", 60, max_tokens=2)  # 4 blocks: only 3 free now -> LATER
    h.add("small", 4, max_tokens=2)  # 1 block: would fit, but must not jump ahead
    assert h.s.kv.can_admit(PrefixHit(), 60) is AllocStatus.LATER
    out = h.step()
    assert ids(out) == ["runner"] and not out.rejected
    admitted: list[str] = []
    while h.s.requests.get("small") is not None and h.s.requests["small"].status is RequestStatus.WAITING:
        out = h.step()
        admitted += [n.request_id for n in out.new_requests()]
    assert admitted == ["big", "small"] or admitted == ["big"]
    h.run_to_end()
    assert h.tokens["big"] == expected_tokens("big", 60, 2)


def test_delay_factor_waits_for_the_oldest_to_age_past_factor_times_last_prompt_latency() -> None:
    h = Harness(scheduler_delay_factor=0.5)
    h.add("a", 8, max_tokens=100)
    assert ids(h.step()) == ["a"]  # nothing running: admitted at once (a prompt step at t=0)
    h.clock.now = 1.0
    h.add("b", 8, max_tokens=100)  # arrives at t=1
    h.clock.now = 2.0  # last prompt step's latency: 2.0 - 0.0 = 2.0; b waited 1.0, not > 0.5 * 2.0
    assert ids(h.step()) == ["a"]
    h.clock.now = 2.1  # waited 1.1 > 1.0
    out = h.step()
    assert ids(out) == ["a", "b"] and [w.is_new for w in out.scheduled] == [False, True]
    # That prompt step (t=2.1 -> next schedule at t=2.4) sets the latency to 0.3: c must wait > 0.15.
    h.clock.now = 2.4
    h.add("c", 8, max_tokens=100)
    assert ids(h.step()) == ["a", "b"]
    h.clock.now = 2.5
    assert ids(h.step()) == ["a", "b"]  # waited 0.1
    h.clock.now = 2.6
    assert ids(h.step()) == ["a", "b", "c"]  # waited 0.2 > 0.15


def test_delay_factor_admits_at_once_when_nothing_runs() -> None:
    h = Harness(scheduler_delay_factor=100.0)
    h.add("a", 8, max_tokens=1)
    h.clock.now = 1.0
    assert ids(h.step()) == ["a"]
    h.clock.now = 50.0
    h.add("b", 8, max_tokens=1)
    assert ids(h.step()) == ["b"]


# ---- lookahead and multi-step --------------------------------------------------------------------


def test_lookahead_slots_are_reserved_at_admission_and_every_step() -> None:
    h = Harness(num_blocks=32, block_size=4, num_lookahead_slots=3)
    h.add("a", 4, max_tokens=20)
    out = h.step()
    assert out.num_lookahead_slots == 3
    assert len(h.s.kv.block_table("a")) == 2  # 4 prompt + 3 lookahead = 7 slots
    for _ in range(10):
        h.step()
        a = h.s.requests["a"]
        # Every step covers computed + 1 scheduled + 3 lookahead slots.
        assert len(h.s.kv.block_table("a")) * 4 >= a.num_computed_tokens + 3
        assert len(h.s.kv.block_table("a")) == -(-(a.num_computed_tokens + 3) // 4)
    h.run_to_end()
    assert h.tokens["a"] == expected_tokens("a", 4, 20)
    assert h.s.kv.device.num_free == 32


def test_multi_step_truncates_at_a_stop_and_frees_blocks() -> None:
    clock = FakeClock()
    cfg = CoreConfig(watermark=0.0, num_scheduler_steps=4)
    s = Scheduler(cfg, ExecutorLimits(16, 64, 0, 4096, (EOS,)), clock=clock)
    s.add_request(make_request("a", 10, max_tokens=50, stop_token_ids=(9,)))
    out = s.schedule()
    assert out.num_steps == 1  # a prefill step is one step
    s.update(out, ExecutorResult(sampled={"a": [5]}))
    out = s.schedule()
    assert out.num_steps == 4 and composition(out) == {"a": 1}
    # 11 tokens known, 10 computed: the 4 steps need slots up to 11 + 3 = 14 -> 1 block of 16.
    assert len(s.kv.block_table("a")) == 1
    deltas = s.update(out, ExecutorResult(sampled={"a": [6, 9, 7, 8]}))  # stop token at the 2nd
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in deltas] == [
        ("a", [6, 9], FinishReason.STOPPED)]
    assert s.kv.device.num_free == 64 and not s.has_unfinished()
    assert s.schedule().finished_ids == ["a"]


def test_multi_step_reserves_slots_across_a_block_boundary() -> None:
    s = Scheduler(CoreConfig(watermark=0.0, num_scheduler_steps=4), ExecutorLimits(4, 64, 0, 4096, (EOS,)),
                  clock=FakeClock())
    ex = ModelExecutor(64, 1, 4)
    s.add_request(make_request("a", 3, max_tokens=9, ignore_eos=True))
    tokens: list[int] = []
    steps = []
    while s.has_unfinished():
        out = s.schedule()
        steps.append(out.num_steps)
        for d in s.update(out, ex.step(out)):
            tokens += d.new_token_ids
    assert steps == [1, 4, 4]  # 1 from the prefill, then 4 + 4 (the last 4 truncated to max_tokens)
    assert tokens == expected_tokens("a", 3, 9)


def test_multi_step_falls_back_to_one_step_while_a_prompt_is_in_the_batch() -> None:
    h = Harness(num_scheduler_steps=4)
    h.add("a", 8, max_tokens=100)
    assert h.step().num_steps == 1
    assert h.step().num_steps == 4
    h.add("b", 8, max_tokens=100)
    out = h.step()
    assert out.num_steps == 1 and composition(out) == {"a": 1, "b": 8}
    assert h.step().num_steps == 4
    assert h.tokens["a"] == expected_tokens("a", 8, 10)


# ---- chunked prefill ---------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_while_decodes_keep_flowing() -> None:
    h = Harness(num_blocks=256, max_num_batched_tokens=512)
    h.add("d1", 8, max_tokens=100)
    h.add("d2", 8, max_tokens=100)
    assert composition(h.step()) == {"d1": 8, "d2": 8}
    h.add("big", 3000, max_tokens=5)
    chunks = []
    for i in range(6):
        out = h.step()
        # Admission reserved blocks for the whole prompt; the chunks never grow the table.
        assert len(h.s.kv.block_table("big")) == 188 and (i == 0) == bool(out.new_requests())
        comp = composition(out)
        assert comp.pop("d1") == 1 and comp.pop("d2") == 1, "decodes stalled behind the prefill"
        chunks.append(comp.pop("big"))
        assert not comp
        assert out.total_num_scheduled_tokens <= 512
    assert chunks == [510] * 5 + [450]
    assert h.s._admitted["big"] == 2
    assert sum(chunks) == 3000
    assert h.tokens["big"] == expected_tokens("big", 3000, 1)  # the last chunk samples its first token
    assert composition(h.step()) == {"d1": 1, "d2": 1, "big": 1}
    assert len(h.tokens["d1"]) == 8
    h.run_to_end()
    assert h.tokens["big"] == expected_tokens("big", 3000, 5)
    assert h.tokens["d1"] == expected_tokens("d1", 8, 100)


def test_two_chunked_recomputes_that_each_need_most_of_the_pool_do_not_livelock() -> None:
    # Found by the property test: when admission reserved only the first chunk's blocks, r6 and r7
    # (7 of 8 blocks each) were readmitted together, starved each other's later chunks, and each
    # preempted itself (both protected) -- forever. Admission now reserves every known token's block.
    h = Harness(num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=8,
                long_prefill_token_threshold=5)
    for i in range(6):
        h.add(f"r{i}", 1, max_tokens=1, ignore_eos=False)
    h.step()
    h.add("r6", 1, max_tokens=25, ignore_eos=False)
    h.add("r7", 2, max_tokens=24, ignore_eos=False)
    h.run_to_end(max_steps=200)
    assert h.tokens["r6"] == expected_tokens("r6", 1, 25) and h.tokens["r7"] == expected_tokens("r7", 2, 24)
    assert h.s.kv.device.num_free == 8


def test_admission_waits_until_the_whole_prompt_fits() -> None:
    h = Harness(num_blocks=8, block_size=4, max_num_batched_tokens=8)
    h.add("runner", 10, max_tokens=3)  # 3 blocks
    h.step()
    h.add("p", 21, max_tokens=2)  # 6 blocks: its first 7-token chunk would fit, the whole prompt not
    assert [w.request.request_id for w in h.step().scheduled if w.is_new] == []
    h.run_to_end()
    assert h.tokens["p"] == expected_tokens("p", 21, 2)


def test_chunked_prefill_off_waits_for_a_whole_prompt_budget() -> None:
    h = Harness(num_blocks=256, max_num_batched_tokens=512, enable_chunked_prefill=False)
    h.add("d1", 8, max_tokens=100)
    h.step()
    h.add("p", 511, max_tokens=2)  # 511 + d1's decode = 512 tokens: fits
    h.add("q", 10, max_tokens=2)  # no budget left this step
    assert composition(h.step()) == {"d1": 1, "p": 511}
    assert composition(h.step()) == {"d1": 1, "p": 1, "q": 10}
    h.add("too-long", 600, max_tokens=2)
    out = h.step()
    assert [d.request_id for d in out.rejected] == ["too-long"]
    assert "max_num_batched_tokens 512" in out.rejected[0].error


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    h = Harness(num_blocks=256, max_num_batched_tokens=512, long_prefill_token_threshold=100)
    h.add("d", 8, max_tokens=100)
    h.step()
    h.add("p", 250, max_tokens=3)
    h.add("q", 120, max_tokens=3)
    comps = [composition(h.step()) for _ in range(4)]
    assert comps == [
        {"d": 1, "p": 100, "q": 100},
        {"d": 1, "p": 100, "q": 20},
        {"d": 1, "p": 50, "q": 1},
        {"d": 1, "p": 1, "q": 1},
    ]
    h.run_to_end()
    assert h.tokens["p"] == expected_tokens("p", 250, 3) and h.tokens["q"] == expected_tokens("q", 120, 3)


# ---- priority preemption -----------------------------------------------------------------------


def test_priority_preemption_when_max_num_seqs_is_exhausted() -> None:
    h = Harness(max_num_seqs=2, policy=Policy.PRIORITY)
    h.add("low1", 8, max_tokens=50, priority=5)
    h.add("low2", 8, max_tokens=50, priority=7)
    h.step()
    h.add("better", 8, max_tokens=5, priority=5)
    h.add("equal", 8, max_tokens=5, priority=7)
    out = h.step()
    # "better" (5) is strictly better than the worst running, low2 (7): low2 goes. Then the worst
    # running one is low1 (5; "better" was admitted this step): "equal" (7) is not better, so it waits.
    assert out.num_preempted == 1
    assert composition(out) == {"low1": 1, "better": 8}
    assert h.s.requests["low2"].status is RequestStatus.WAITING
    assert h.s.requests["equal"].status is RequestStatus.WAITING
    h.run_to_end()
    assert h.tokens["low2"] == expected_tokens("low2", 8, 50)


def test_priority_preemption_when_blocks_are_exhausted() -> None:
    h = Harness(num_blocks=4, block_size=4, policy=Policy.PRIORITY, cpu_blocks=8)
    h.add("low", 12, max_tokens=3, priority=9)  # 3 of 4 blocks
    h.step()
    h.add("high", 7, max_tokens=3, priority=0)  # 2 blocks: only 1 free
    out = h.step()
    assert out.num_preempted == 1 and out.swapped_out_ids == ["low"]  # swap: low had computed tokens
    assert composition(out) == {"high": 7}
    h.run_to_end()
    assert h.tokens["low"] == expected_tokens("low", 12, 3)
    assert h.tokens["high"] == expected_tokens("high", 7, 3)


def test_no_priority_preemption_under_fcfs() -> None:
    h = Harness(max_num_seqs=1)
    h.add("first", 8, max_tokens=3, priority=9)
    h.step()
    h.add("urgent", 8, max_tokens=3, priority=0)
    assert ids(h.step()) == ["first"]
    assert h.s.stats().num_preemptions_recompute == 0
