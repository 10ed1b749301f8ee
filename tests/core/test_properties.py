"""Random traces against the pure core and a KV-checking executor model; invariants after every step."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import ExecutorResult
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import (
    BLOCK,
    EOS,
    EOS2,
    FakeClock,
    TraceSpec,
    add_trace_arrivals,
    check_columns,
    check_invariants,
    config_spec,
    end_trace_requests,
    max_model_len_spec,
    request_spec,
    trace_limits,
    update_and_record,
)
from tests.support.model_executor import ModelExecutor, token_at


def reshape(result: ExecutorResult, rng: random.Random, errors: dict[str, str]) -> ExecutorResult:
    """The same answer in another shape: columns in any order, or token lists; sometimes with logprobs
    (they take the per-request path), an executor error for one request, one request's token missing
    (it fails alone) or a token for a request the step did not name."""
    sampled = dict(result.sampled) or {rid: [t] for rid, t in zip(result.ids, result.tokens, strict=True)}
    shape = rng.randrange(6)
    if shape == 3 and sampled and rng.randrange(25) == 0:  # a token missing: that request fails, alone
        missing = rng.choice(sorted(sampled))
        del sampled[missing]
        errors[missing] = "no token"
    if shape == 4:  # a token for a request the step did not name is ignored
        sampled = {"not-scheduled": [3], **sampled}
    ids = list(sampled)
    rng.shuffle(ids)
    if shape == 0 or any(len(t) != 1 for t in sampled.values()):
        reshaped = ExecutorResult(sampled={rid: sampled[rid] for rid in ids})
    else:
        reshaped = ExecutorResult(ids=ids, tokens=[sampled[rid][0] for rid in ids])
    if shape == 1 and ids:
        reshaped.logprobs = {ids[0]: [TokenLogprob(t, -1.0) for t in sampled[ids[0]]]}
    if shape == 2 and ids and rng.randrange(25) == 0:
        reshaped.errors = {ids[-1]: "injected"}
        errors[ids[-1]] = "injected"
    return reshaped


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
    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    stopped_outside: set[str] = set()
    errors: dict[str, str] = {}
    copies = shared_swaps = 0
    for step in range(600):
        clock.now = step * 0.01
        for request in add_trace_arrivals(s, specs, step, clock.now):
            requests[request.request_id] = request
            outputs[request.request_id] = []
        if not end_mid_step:
            end_trace_requests(s, specs, step, reasons, stopped_outside)
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
                reasons[rejected.request_id] = FinishReason.ERROR
            check_columns(s)
            continue
        result = reshape(ex.step(out), rng, errors)
        if end_mid_step:  # an abort or a stop string while the executor runs the step
            end_trace_requests(s, specs, step, reasons, stopped_outside)
        update_and_record(s, out, result, outputs, reasons)
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    assert not s.has_unfinished(), f"requests never finished: {list(s.requests)}"
    event(f"prefix cache hits: {s.stats().prefix_cache_hits > 0}")
    event(f"n > 1 copy-on-write: {copies > 0}")
    event(f"swap-out of a block another request kept: {shared_swaps > 0}")
    assert s.kv.device.num_free == device_blocks and s.kv.cpu.num_free == cpu_blocks
    for rid, req in requests.items():
        reason = reasons[rid]
        expected = expected_output(req, limits.max_model_len)
        if rid in stopped_outside or rid in errors:
            assert outputs[rid] == expected[0][:len(outputs[rid])], rid
            continue
        if reason in (FinishReason.ABORTED, FinishReason.ERROR):
            continue
        event(f"finished by {reason.value}{' at max_model_len' if req.num_tokens >= max_model_len else ''}")
        assert (outputs[rid], reason) == expected, rid


def expected_output(req: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    n = req.num_prompt_tokens
    options = req.sampling
    while True:
        t = token_at(req.request_id, n + len(out), EOS, 23)
        out.append(t)
        if len(out) < options.min_tokens:
            if n + len(out) >= max_model_len:
                return out, FinishReason.LENGTH
            continue
        if (not options.ignore_eos and t in (EOS, EOS2)) or t in options.stop_token_ids:
            return out, FinishReason.STOPPED
        if n + len(out) >= max_model_len or len(out) >= options.max_tokens:
            return out, FinishReason.LENGTH
