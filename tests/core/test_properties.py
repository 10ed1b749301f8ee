"""Random traces against the pure core and a KV-checking executor model; invariants after every step."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.request import FinishReason
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import (
    BLOCK,
    EOS,
    FakeClock,
    TraceSpec,
    check_columns,
    check_invariants,
    config_spec,
    end_trace_requests,
    max_model_len_spec,
    request_spec,
    trace_limits,
    update_and_record,
)
from tests.support.model_executor import ModelExecutor
from tests.support.trace_outputs import TraceOutputs, check_trace_outputs, reshape


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=14), cfg_kwargs=config_spec,
       device_blocks=st.integers(4, 40), cpu_blocks=st.integers(0, 30), max_model_len=max_model_len_spec,
       seed=st.integers(0, 2**16), end_mid_step=st.booleans(), lose_at=st.sampled_from([0, 0, 3, 10, 25]),
       move_at=st.sampled_from([0, 0, 2, 6, 12]))
def test_random_traces_keep_invariants_and_finish(specs: list[TraceSpec],
                                                  cfg_kwargs: dict[str, object], device_blocks: int,
                                                  cpu_blocks: int, max_model_len: int, seed: int,
                                                  end_mid_step: bool, lose_at: int, move_at: int) -> None:
    cfg = CoreConfig(**cfg_kwargs)  # type: ignore[arg-type]
    limits = trace_limits(device_blocks, cpu_blocks, max_model_len)
    clock = FakeClock()
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23)
    rng = random.Random(seed)
    trace = TraceOutputs()
    copies = shared_swaps = 0
    for step in range(600):
        clock.now = step * 0.01
        trace.add_arrivals(s, specs, step, clock.now)
        if not end_mid_step:
            end_trace_requests(s, specs, step, trace.reasons, trace.stopped_outside)
        if step == move_at:  # a pool takes the waiting requests away and (here) hands them back
            moved = [s.release(rid) for rid in s.waiting_ids()]
            for waiting in reversed(moved):
                assert waiting is not None and waiting.slot == -1
                s.add_request(waiting, front=True)
        before = {r.request_id: list(s.kv.block_table(r.request_id)) for r in s.running}
        out = s.schedule()
        check_invariants(s, out, cfg, before)
        check_columns(s)
        copies += len(out.copy)
        shared_swaps += sum(1 for a, _ in out.swap_out if s.kv.device.ref_count(a) > 0)
        if step == lose_at:  # the executor is lost with the step: its state goes, every request recomputes
            s.reset_executor()
            s.set_executor_limits(limits)
            ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23)
            for rejected in out.rejected:
                trace.reasons[rejected.request_id] = FinishReason.ERROR
            check_columns(s)
            continue
        result = reshape(ex.step(out), rng, trace.errors)
        if end_mid_step:  # an abort or a stop string while the executor runs the step
            end_trace_requests(s, specs, step, trace.reasons, trace.stopped_outside)
        update_and_record(s, out, result, trace.outputs, trace.reasons)
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    event(f"prefix cache hits: {s.stats().prefix_cache_hits > 0}")
    event(f"n > 1 copy-on-write: {copies > 0}")
    event(f"swap-out of a block another request kept: {shared_swaps > 0}")
    check_trace_outputs(s, trace, limits)
