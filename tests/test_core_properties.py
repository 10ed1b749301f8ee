"""Random traces against the pure core and a KV-checking executor model; invariants after every step."""

from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import Scheduler
from tests.core_helpers import (
    BLOCK,
    EOS,
    FakeClock,
    TraceSpec,
    check_invariants,
    config_spec,
    play_trace_step,
    request_spec,
    trace_limits,
)
from tests.model_executor import ModelExecutor, token_at


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=14), cfg_kwargs=config_spec,
       device_blocks=st.integers(4, 40), cpu_blocks=st.integers(0, 30))
def test_random_traces_keep_invariants_and_finish(specs: list[TraceSpec],
                                                  cfg_kwargs: dict[str, object], device_blocks: int,
                                                  cpu_blocks: int) -> None:
    cfg = CoreConfig(**cfg_kwargs)  # type: ignore[arg-type]
    limits = trace_limits(device_blocks, cpu_blocks)
    clock = FakeClock()
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23)
    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    copies = shared_swaps = 0
    for step in range(600):
        clock.now = step * 0.01
        for request in play_trace_step(s, specs, step, clock.now, reasons):
            requests[request.request_id] = request
            outputs[request.request_id] = []
        before = {r.request_id: list(s.kv.block_table(r.request_id)) for r in s.running}
        out = s.schedule()
        check_invariants(s, out, cfg, before)
        copies += len(out.copy)
        shared_swaps += sum(1 for a, _ in out.swap_out if s.kv.device.ref_count(a) > 0)
        for d in s.update(out, ex.step(out)):
            outputs[d.request_id] += d.new_token_ids
            if d.finish_reason is not None:
                reasons[d.request_id] = d.finish_reason
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    assert not s.has_unfinished(), f"requests never finished: {list(s.requests)}"
    event(f"prefix cache hits: {s.stats().prefix_cache_hits > 0}")
    event(f"n > 1 copy-on-write: {copies > 0}")
    event(f"swap-out of a block another request kept: {shared_swaps > 0}")
    assert s.kv.device.num_free == device_blocks and s.kv.cpu.num_free == cpu_blocks
    for rid, req in requests.items():
        reason = reasons[rid]
        if reason in (FinishReason.ABORTED, FinishReason.ERROR):
            continue
        assert (outputs[rid], reason) == expected_output(req, limits.max_model_len), rid


def expected_output(req: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    n = req.num_prompt_tokens
    while True:
        t = token_at(req.request_id, n + len(out), EOS, 23)
        out.append(t)
        if n + len(out) >= max_model_len:
            return out, FinishReason.LENGTH
        if not req.sampling.ignore_eos and t == EOS:
            return out, FinishReason.STOPPED
        if len(out) >= req.sampling.max_tokens:
            return out, FinishReason.LENGTH
