"""Random traces against the pure core and a KV-checking executor model; invariants after every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig, ModelLimits, PreemptionMode, Victim
from scheduler_service.core.outputs import SchedulerOutput
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.core_helpers import FakeClock
from tests.model_executor import ModelExecutor, token_at

EOS = 2
BLOCK = 4

request_spec = st.tuples(
    st.integers(0, 6),          # arrival step
    st.integers(1, 40),         # prompt length
    st.integers(1, 30),         # max_tokens
    st.integers(0, 5),          # priority
    st.booleans(),              # ignore_eos
    st.integers(0, 60),         # abort at step (0 = never)
    st.integers(0, 3),          # shared prefix (0 = none): the prompt starts with one of three prefixes
    st.sampled_from([1, 1, 1, 2, 3]),  # n: parallel sequences sharing the prompt
)

PREFIXES = {k: [9 + (k * 7 + j) % 31 for j in range(4 * k + 3)] for k in (1, 2, 3)}

config_spec = st.fixed_dictionaries({
    "policy": st.sampled_from(list(Policy)),
    "preemption_mode": st.sampled_from(list(PreemptionMode)),
    "preemption_victim": st.sampled_from(list(Victim)),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.integers(8, 64),
    "num_lookahead_slots": st.integers(0, 3),
    "num_scheduler_steps": st.sampled_from([1, 1, 3]),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 5]),
    "aging_rate": st.sampled_from([0.0, 0.5]),
    "watermark": st.sampled_from([0.0, 0.1]),
    "enable_prefix_caching": st.sampled_from([True, True, False]),
})


def check_invariants(s: Scheduler, out: SchedulerOutput, cfg: CoreConfig, before: dict[str, list[int]]) -> None:
    bm = s.kv
    device_tables = {r.request_id: bm.block_table(r.request_id) for r in s.running}
    assert set(bm._tables) == set(device_tables), "a table outlived its request's RUNNING state"
    assert all(len(set(t)) == len(t) for t in device_tables.values()), "a table holds a block twice"
    held = Counter(b for t in device_tables.values() for b in t)
    refs = bm.device._refs
    assert all(r >= 0 for r in refs), "a negative reference count"
    assert all(refs[b] == c for b, c in held.items()), "a reference count differs from the tables holding it"
    assert sum(1 for r in refs if r > 0) == len(held)
    assert bm.device.num_free + len(held) == bm.device.num_blocks
    assert bm.device.free_blocks() == {b for b in range(bm.device.num_blocks) if refs[b] == 0}
    assert all(bm.device._keys[b] == k for k, b in bm.device._cached.items())
    cpu_held = Counter(b for ids in bm._cpu_tables.values() for b in ids)
    assert all(c == 1 for c in cpu_held.values()), "a swap block is held twice"
    assert bm.cpu.num_free + sum(cpu_held.values()) == bm.cpu.num_blocks
    assert set(bm._cpu_tables) == {r.request_id for r in s.swapped}
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(s.running) <= cfg.max_num_seqs
    for rid in out.swapped_out_ids:
        assert rid in bm._cpu_tables
    out_src = [a for a, _ in out.swap_out]
    out_dst = [b for _, b in out.swap_out]
    assert len(set(out_dst)) == len(out_dst)
    held_before: dict[int, set[str]] = {}
    for rid, t in before.items():
        for b in t:
            held_before.setdefault(b, set()).add(rid)
    assert all(held_before.get(b, set()) & set(out.swapped_out_ids) for b in out_src)
    assert {b for _, b in out.swap_out} <= set(cpu_held)
    for rid in {w.request.request_id for w in out.scheduled if w.resumed}:
        assert set(device_tables[rid]) >= {b for _, b in out.swap_in if b in device_tables[rid]}
    assert all(r.status is RequestStatus.RUNNING for r in s.running)
    assert all(r.status is RequestStatus.SWAPPED for r in s.swapped)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=14), cfg_kwargs=config_spec,
       device_blocks=st.integers(4, 40), cpu_blocks=st.integers(0, 30))
def test_random_traces_keep_invariants_and_finish(specs: list[tuple[int, int, int, int, bool, int, int, int]],
                                                  cfg_kwargs: dict[str, object], device_blocks: int,
                                                  cpu_blocks: int) -> None:
    cfg = CoreConfig(**cfg_kwargs)  # type: ignore[arg-type]
    limits = ModelLimits(BLOCK, device_blocks, cpu_blocks, max_model_len=96, eos_token_ids=(EOS,))
    clock = FakeClock()
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23)
    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    copies = shared_swaps = 0
    for step in range(600):
        clock.now = step * 0.01
        for i, (arrive, plen, max_tokens, prio, ignore_eos, _, prefix, n) in enumerate(specs):
            if arrive == step:
                opts = SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos, priority=prio)
                prompt = (PREFIXES.get(prefix, []) + [5 + (i + k) % 40 for k in range(plen)])[:max(plen, 1)]
                for j in range(n):
                    rid = f"r{i}.{j}"
                    requests[rid] = Request(rid, list(prompt), opts, clock.now,
                                            share_prompt_with=f"r{i}.0" if j else None)
                    outputs[rid] = []
                    s.add_request(requests[rid])
        for i, spec in enumerate(specs):
            for j in range(spec[7]):
                if spec[5] == step and f"r{i}.{j}" in s.requests:
                    s.abort(f"r{i}.{j}")
                    reasons[f"r{i}.{j}"] = FinishReason.ABORTED
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
