"""Async scheduling in the pure core: step N+1 is scheduled (and run by the executor model) before
update() of step N. Random traces must give every request exactly the tokens of synchronous mode,
keep the KV cache intact (the executor model checks every cached slot), and free every block."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import (
    BLOCK,
    EOS,
    FakeClock,
    TraceSpec,
    check_columns,
    check_invariants,
    config_spec,
    held_tables,
    max_model_len_spec,
    play_trace_step,
    request_spec,
    trace_limits,
    update_and_record,
)
from tests.support.model_executor import ModelExecutor

Trace = tuple[dict[str, list[int]], dict[str, FinishReason]]


def drive(specs: list[TraceSpec], cfg: CoreConfig, device_blocks: int, cpu_blocks: int,
          steps_in_flight: int = 1, max_model_len: int = 96, lose_at: int = 0, groups: int = 0,
          window: int = 0) -> Trace:
    """groups > 0: a hybrid model's sliding-window KV cache groups (test_window_groups.py)."""
    clock = FakeClock()
    limits = replace(trace_limits(device_blocks, cpu_blocks, max_model_len), num_window_groups=groups, window=window)
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23, window_groups=groups, window=window)
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    pending: list[tuple[SchedulerOutput, ExecutorResult]] = []

    def apply(out: SchedulerOutput, result: ExecutorResult) -> None:
        update_and_record(s, out, result, outputs, reasons)

    for step in range(1200):
        clock.now = step * 0.01
        for request in play_trace_step(s, specs, step, clock.now, reasons):
            outputs[request.request_id] = []
        before = held_tables(s)
        in_flight = {r.request_id for r in s.running if s.rs.inflight[r.slot]}
        out = s.schedule()
        # A request whose last step is still running and that ends there stays in RUNNING until its
        # update: it holds no place in this step's batch, which alone max_num_seqs bounds.
        ending = in_flight - {w.request.request_id for w in out.scheduled}
        check_invariants(s, out, replace(cfg, max_num_seqs=cfg.max_num_seqs + len(ending)), before)
        check_columns(s)
        leaving = set(out.finished_ids) | set(out.swapped_out_ids)
        assert all(s.kv.device.ref_count(b) > 0 for rid, st_ in ex.states.items() if rid not in leaving
                   for b in ex._blocks_of(st_)), "the executor still reads a block the scheduler released"
        if step == lose_at:  # the executor is lost with every step in flight: each request recomputes
            for lost in (*(o for o, _ in pending), out):
                for d in lost.rejected:
                    reasons[d.request_id] = FinishReason.ERROR
            pending.clear()
            s.reset_executor()
            s.set_executor_limits(limits)
            ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23, window_groups=groups,
                               window=window)
            check_columns(s)
            continue
        result = ex.step(out)  # the executor runs steps in the order they are sent
        pending.append((out, result))
        if len(pending) >= steps_in_flight:
            apply(*pending.pop(0))
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    for late in pending:
        apply(*late)
    assert not s.has_unfinished(), f"requests never finished: {list(s.requests)}"
    assert s.kv.device.num_free == device_blocks and s.kv.cpu.num_free == cpu_blocks
    return outputs, reasons


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=14), cfg_kwargs=config_spec,
       device_blocks=st.integers(4, 40), cpu_blocks=st.integers(0, 30), steps_in_flight=st.integers(2, 4),
       max_model_len=max_model_len_spec, lose_at=st.sampled_from([0, 0, 3, 10, 25]))
def test_async_traces_give_the_tokens_of_sync_mode(specs: list[TraceSpec],
                                                   cfg_kwargs: dict[str, object], device_blocks: int,
                                                   cpu_blocks: int, steps_in_flight: int, max_model_len: int,
                                                   lose_at: int) -> None:
    kwargs = {**cfg_kwargs, "num_scheduler_steps": 1}
    sync_out, sync_reasons = drive(specs, CoreConfig(**kwargs), device_blocks, cpu_blocks,  # type: ignore[arg-type]
                                   max_model_len=max_model_len, lose_at=lose_at)
    async_out, async_reasons = drive(specs, CoreConfig(**kwargs, async_scheduling=True),  # type: ignore[arg-type]
                                     device_blocks, cpu_blocks, steps_in_flight, max_model_len, lose_at)
    stopped_outside = {f"r{i}.{j}" for i, spec in enumerate(specs) if spec[10] for j in range(spec[7])}
    for rid in stopped_outside & set(sync_out):  # a stop string at a fixed step: the modes are elsewhere by then
        shorter, longer = sorted((sync_out[rid], async_out[rid]), key=len)
        assert longer[:len(shorter)] == shorter, rid
        sync_reasons.pop(rid, None)
    skip = (FinishReason.ABORTED, FinishReason.ERROR)
    for rid, reason in sync_reasons.items():
        if reason in skip or async_reasons[rid] in skip:
            # Aborted at a fixed step: the two modes are at different points by then. ERROR: a request
            # preempted by recompute may no longer fit max_num_batched_tokens with chunked prefill off,
            # and the two modes pick different victims (a request in flight is never one).
            continue
        assert (async_out[rid], async_reasons[rid]) == (sync_out[rid], reason), rid


def test_a_token_sampled_past_a_stop_is_dropped_and_blocks_stay_held_for_the_executor() -> None:
    cfg = CoreConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0, async_scheduling=True)
    s = Scheduler(cfg, ExecutorLimits(BLOCK, 16, 0, max_model_len=96, eos_token_ids=(EOS,)))
    ex = ModelExecutor(16, 0, BLOCK, eos=EOS, eos_every=23)
    s.add_request(Request("r", [5] * 6, SamplingOptions(max_tokens=50), 0.0))
    first = s.schedule()
    r1 = ex.step(first)
    second = s.schedule()  # scheduled ahead: the executor has not answered `first`
    assert [(w.request.request_id, w.num_tokens) for w in second.scheduled] == [("r", 1)]
    r2 = ex.step(second)
    s.finish("r", FinishReason.STOPPED)  # e.g. a stop string seen in the first token
    assert [d.new_token_ids for d in s.update(first, r1)] == []
    assert list(s.update(second, r2)) == [], "the token sampled past the stop never reaches a client"
    assert s.schedule().finished_ids == ["r"]
    assert s.kv.device.num_free == 16


def test_with_three_steps_in_flight_a_request_decodes_ahead_twice_and_stops_at_max_tokens() -> None:
    cfg = CoreConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0, async_scheduling=True)
    s = Scheduler(cfg, ExecutorLimits(BLOCK, 16, 0, max_model_len=96, eos_token_ids=(EOS,)))
    ex = ModelExecutor(16, 0, BLOCK)
    request = Request("r", [5] * 6, SamplingOptions(max_tokens=4, ignore_eos=True), 0.0)
    s.add_request(request)
    sent = [s.schedule() for _ in range(3)]  # nothing updated yet: the executor has all three
    assert [[w.num_tokens for w in out.scheduled] for out in sent] == [[6], [1], [1]]
    results = [ex.step(out) for out in sent]
    tokens = [t for out, res in zip(sent, results, strict=True) for d in s.update(out, res) for t in d.new_token_ids]
    assert len(tokens) == 3 and not request.is_finished
    last = s.schedule()
    assert [w.num_tokens for w in last.scheduled] == [1], "the 4th token, and no 5th (max_tokens is known)"
    assert s.schedule().scheduled == [], "it surely ends with the step in flight"
    deltas = s.update(last, ex.step(last))
    assert deltas[0].finish_reason is FinishReason.LENGTH and len(tokens) + len(deltas[0].new_token_ids) == 4


def test_a_new_request_reusing_a_finished_ones_id_is_not_taken_for_it() -> None:
    cfg = CoreConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0, async_scheduling=True)
    s = Scheduler(cfg, ExecutorLimits(BLOCK, 16, 0, max_model_len=96, eos_token_ids=(EOS,)))
    ex = ModelExecutor(16, 0, BLOCK)
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    s.add_request(Request("x", [5] * 6, options, 0.0))
    sent = [s.schedule(), s.schedule()]
    s.finish("x", FinishReason.STOPPED)  # a stop string, with two steps of the old "x" in flight
    s.add_request(Request("x", [9] * 3, SamplingOptions(max_tokens=3, ignore_eos=True), 0.0))
    sent.append(s.schedule())
    assert [(w.num_tokens, w.is_new) for w in sent[2].scheduled] == [(3, True)]
    sent.append(s.schedule())  # three steps unupdated; the new "x" has one of them
    assert [(w.num_tokens, w.is_new) for w in sent[3].scheduled] == [(1, False)]
    results = [ex.step(out) for out in sent]
    deltas = [d for out, res in zip(sent, results, strict=True) for d in s.update(out, res)]
    assert [len(d.new_token_ids) for d in deltas] == [1, 1], "the old x's tokens are dropped"


# The configuration of the hybrid examples below (a config_spec draw).
HYBRID_EXAMPLE_CFG: dict[str, object] = {
    "policy": Policy.FCFS, "preemption_mode": PreemptionMode.AUTO, "preemption_victim": Victim.LATEST,
    "max_num_seqs": 2, "max_num_batched_tokens": 12, "num_lookahead_slots": 0, "num_scheduler_steps": 1,
    "enable_chunked_prefill": True, "long_prefill_token_threshold": 5, "aging_rate": 0.0, "watermark": 0.0,
    "enable_prefix_caching": False, "speculative_config": None}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=12), cfg_kwargs=config_spec,
       device_blocks=st.integers(8, 60), cpu_blocks=st.integers(0, 40), steps_in_flight=st.integers(2, 4),
       max_model_len=max_model_len_spec, lose_at=st.sampled_from([0, 0, 3, 10, 25]),
       groups=st.sampled_from([1, 2]), window=st.sampled_from([1, 5, 8, 13]))
@example(  # two chunked prefills whose window tables cannot both grow: they took turns preempting themselves
    specs=[(0, 1, 1, 0, False, 0, 0, 1, 0, 0, 0)] * 9 + [(2, 13, 1, 0, False, 0, 0, 1, 0, 0, 0)] * 2,
    cfg_kwargs=HYBRID_EXAMPLE_CFG, device_blocks=18, cpu_blocks=0, steps_in_flight=2, max_model_len=96, lose_at=0,
    groups=2, window=8)
@example(  # the same, where the prompts' last chunks grow the window tables by the lookahead slots too
    specs=[(2, 8, 7, 0, True, 0, 0, 1, 0, 0, 0), (5, 14, 1, 0, True, 0, 0, 1, 0, 0, 0),
           (3, 5, 11, 0, True, 0, 0, 1, 0, 0, 0)],
    cfg_kwargs={**HYBRID_EXAMPLE_CFG, "preemption_mode": PreemptionMode.RECOMPUTE, "max_num_batched_tokens": 6,
                "num_lookahead_slots": 3, "long_prefill_token_threshold": 0},
    device_blocks=24, cpu_blocks=0, steps_in_flight=3, max_model_len=96, lose_at=0, groups=2, window=13)
@example(  # chunks shorter than a block: no reserve helps; the oldest prefill, all others guarded, waits its turn
    specs=[(1, 17, 1, 0, True, 0, 0, 1, 0, 0, 0), (2, 17, 1, 0, True, 0, 0, 1, 0, 0, 0)],
    cfg_kwargs={**HYBRID_EXAMPLE_CFG, "preemption_mode": PreemptionMode.RECOMPUTE, "preemption_victim": Victim.LONGEST,
                "long_prefill_token_threshold": 3},
    device_blocks=16, cpu_blocks=0, steps_in_flight=2, max_model_len=96, lose_at=0, groups=2, window=1)
@example(  # the oldest waits for room: it keeps its place among max_num_seqs, and no one is admitted beside it
    specs=[(0, 1, 1, 0, False, 0, 0, 1, 0, 0, 0), (1, 23, 1, 0, False, 0, 0, 1, 0, 0, 0),
           (1, 17, 1, 0, False, 0, 0, 1, 0, 0, 0), (1, 1, 1, 0, False, 0, 0, 1, 0, 0, 0)],
    cfg_kwargs={**HYBRID_EXAMPLE_CFG, "policy": Policy.PRIORITY, "preemption_mode": PreemptionMode.SWAP,
                "max_num_batched_tokens": 8, "long_prefill_token_threshold": 3},
    device_blocks=21, cpu_blocks=20, steps_in_flight=2, max_model_len=96, lose_at=0, groups=3, window=1)
def test_async_hybrid_traces_give_the_tokens_of_sync_mode(specs: list[TraceSpec], cfg_kwargs: dict[str, object],
                                                          device_blocks: int, cpu_blocks: int, steps_in_flight: int,
                                                          max_model_len: int, lose_at: int, groups: int,
                                                          window: int) -> None:
    """Sliding-window groups under async scheduling: the scheduler releases window blocks by its own (older)
    computed count, never a block the executor, steps ahead, still reads; tokens as in sync mode."""
    kwargs = {**cfg_kwargs, "num_scheduler_steps": 1}
    sync_out, sync_reasons = drive(specs, CoreConfig(**kwargs), device_blocks, cpu_blocks,  # type: ignore[arg-type]
                                   max_model_len=max_model_len, lose_at=lose_at, groups=groups, window=window)
    async_out, async_reasons = drive(specs, CoreConfig(**kwargs, async_scheduling=True),  # type: ignore[arg-type]
                                     device_blocks, cpu_blocks, steps_in_flight, max_model_len, lose_at, groups, window)
    for rid, reason in sync_reasons.items():
        if reason in (FinishReason.ABORTED, FinishReason.ERROR) or async_reasons[rid] in (
                FinishReason.ABORTED, FinishReason.ERROR) or any(spec[10] for spec in specs):
            continue
        assert (async_out[rid], async_reasons[rid]) == (sync_out[rid], reason), rid
