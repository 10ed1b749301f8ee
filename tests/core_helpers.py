"""In-process stand-ins to drive the pure scheduler core in tests, and the random traces (hypothesis) that
the property tests of the synchronous and the async core share."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

from hypothesis import strategies as st

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

EOS = 2
BLOCK = 4
# arrival step, prompt length, max_tokens, priority, ignore_eos, abort at step, shared prefix, n
TraceSpec = tuple[int, int, int, int, bool, int, int, int]

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


def trace_limits(device_blocks: int, cpu_blocks: int) -> ExecutorLimits:
    return ExecutorLimits(BLOCK, device_blocks, cpu_blocks, max_model_len=96, eos_token_ids=(EOS,))


def play_trace_step(s: Scheduler, specs: list[TraceSpec], step: int, now: float,
                    reasons: dict[str, FinishReason]) -> list[Request]:
    """Add the requests of `specs` that arrive at `step` (n sequences each, the later ones sharing the
    first's prompt) and abort those due now (recorded in `reasons`); returns the requests added."""
    added: list[Request] = []
    for i, (arrive, plen, max_tokens, prio, ignore_eos, _, prefix, n) in enumerate(specs):
        if arrive == step:
            opts = SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos, priority=prio)
            prompt = (PREFIXES.get(prefix, []) + [5 + (i + k) % 40 for k in range(plen)])[:max(plen, 1)]
            for j in range(n):
                added.append(Request(f"r{i}.{j}", list(prompt), opts, now, share_prompt_with=f"r{i}.0" if j else None))
                s.add_request(added[-1])
    for i, spec in enumerate(specs):
        for j in range(spec[7]):
            if spec[5] == step and f"r{i}.{j}" in s.requests:
                s.abort(f"r{i}.{j}")
                reasons[f"r{i}.{j}"] = FinishReason.ABORTED
    return added


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




class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, prompt_len: int, max_tokens: int = 16, arrival: float = 0.0,
                 **sampling: object) -> Request:
    """A prompt of prompt_len tokens that starts with a token of its own, so no two requests share a
    cached prefix unless a test gives them one."""
    options = SamplingOptions(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, ([1000 + zlib.crc32(rid.encode()) % 10_000] + [7] * (prompt_len - 1))[:prompt_len],
                   options, arrival)


def token_for(rid: str, position: int) -> int:
    return 100 + (hash((rid, position)) % 1000)


def run_step(out: SchedulerOutput, chooser: Callable[[str, int], int] = token_for) -> ExecutorResult:
    """Answer a step the way an executor would: tokens for every request whose tokens are all computed."""
    result = ExecutorResult()
    for work in out.scheduled:
        req = work.request
        if req.num_computed_tokens + work.num_tokens < req.num_tokens:
            continue
        position = req.num_tokens
        result.sampled[req.request_id] = [chooser(req.request_id, position + i) for i in range(out.num_steps)]
    return result
