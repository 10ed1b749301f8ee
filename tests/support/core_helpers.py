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
from scheduler_service.core.speculative import SpeculativeConfig

EOS = 2
EOS2 = 13  # a second EOS id (a model with several), which the model executor samples now and then
BLOCK = 4
# arrival step, prompt length, max_tokens, priority, ignore_eos, abort at step, shared prefix, n, min_tokens,
# stop token id (0 = none), finished from outside (a stop string) at step (0 = never)
TraceSpec = tuple[int, int, int, int, bool, int, int, int, int, int, int]

request_spec = st.tuples(
    st.sampled_from([0, 0, 1, 2, 3, 5, 8, 12, 20]),  # arrival step
    st.integers(1, 40),         # prompt length
    st.integers(1, 30),         # max_tokens
    st.integers(0, 5),          # priority
    st.booleans(),              # ignore_eos
    st.one_of(st.just(0), st.just(0), st.integers(1, 60)),  # abort at step (0 = never)
    st.integers(0, 3),          # shared prefix (0 = none): the prompt starts with one of three prefixes
    st.sampled_from([1, 1, 1, 2, 3]),  # n: parallel sequences sharing the prompt
    st.sampled_from([0, 0, 0, 2, 5]),  # min_tokens (capped at max_tokens)
    st.sampled_from([0, 0, 0, 7, 11]),  # a stop token id (the model samples 3..52)
    st.sampled_from([0, 0, 0, 0, 5, 9, 20]),  # finished from outside at step (0 = never)
)

TRACE_OWNERS = ("", "key-a", "key-b")  # the waiting queue takes turns between them

PREFIXES = {k: [9 + (k * 7 + j) % 31 for j in range(4 * k + 3)] for k in (1, 2, 3)}

TRACE_SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3,
                               disable_by_batch_size=64)
config_spec = st.fixed_dictionaries({
    "policy": st.sampled_from(list(Policy)),
    "preemption_mode": st.sampled_from(list(PreemptionMode)),
    "preemption_victim": st.sampled_from(list(Victim)),
    "max_num_seqs": st.integers(1, 8),
    "max_num_batched_tokens": st.sampled_from([4, 6, 8, 12, 16, 32, 64]),
    "num_lookahead_slots": st.integers(0, 3),
    "num_scheduler_steps": st.sampled_from([1, 1, 3]),
    "enable_chunked_prefill": st.booleans(),
    "long_prefill_token_threshold": st.sampled_from([0, 0, 5]),
    "aging_rate": st.sampled_from([0.0, 0.5]),
    "watermark": st.sampled_from([0.0, 0.1]),
    "enable_prefix_caching": st.sampled_from([True, True, False]),
    "speculative_config": st.sampled_from([None, None, TRACE_SPEC]),
})
max_model_len_spec = st.sampled_from([96, 96, 40, 24])


def trace_limits(device_blocks: int, cpu_blocks: int, max_model_len: int = 96) -> ExecutorLimits:
    return ExecutorLimits(BLOCK, device_blocks, cpu_blocks, max_model_len=max_model_len,
                          eos_token_ids=(EOS, EOS2), max_num_draft_tokens=4)


def trace_options(spec: TraceSpec) -> SamplingOptions:
    _, _, max_tokens, prio, ignore_eos, _, _, _, min_tokens, stop, _ = spec
    return SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos, priority=prio,
                           min_tokens=min(min_tokens, max_tokens), stop_token_ids=(stop,) if stop else ())


def play_trace_step(s: Scheduler, specs: list[TraceSpec], step: int, now: float,
                    reasons: dict[str, FinishReason], stopped_outside: set[str] | None = None) -> list[Request]:
    """Add the requests of `specs` that arrive at `step`, then end those due now (end_trace_requests)."""
    added = add_trace_arrivals(s, specs, step, now)
    end_trace_requests(s, specs, step, reasons, stopped_outside)
    return added


def add_trace_arrivals(s: Scheduler, specs: list[TraceSpec], step: int, now: float) -> list[Request]:
    """Add the requests of `specs` that arrive at `step` (n sequences each, the later ones sharing the
    first's prompt); returns the requests added."""
    added: list[Request] = []
    for i, spec in enumerate(specs):
        arrive, plen, prefix, n = spec[0], spec[1], spec[6], spec[7]
        if arrive == step:
            opts = trace_options(spec)
            prompt = (PREFIXES.get(prefix, []) + [5 + (i + k) % 40 for k in range(plen)])[:max(plen, 1)]
            for j in range(n):
                added.append(Request(f"r{i}.{j}", list(prompt), opts, now, share_prompt_with=f"r{i}.0" if j else None,
                                     owner=TRACE_OWNERS[i % len(TRACE_OWNERS)]))
                s.add_request(added[-1])
    return added


def end_trace_requests(s: Scheduler, specs: list[TraceSpec], step: int, reasons: dict[str, FinishReason],
                       stopped_outside: set[str] | None = None) -> None:
    """Abort the requests due now and finish those a stop string ends now (recorded in `reasons`, and
    the latter in `stopped_outside`)."""
    for i, spec in enumerate(specs):
        for j in range(spec[7]):
            rid = f"r{i}.{j}"
            if spec[5] == step and rid in s.requests:
                s.abort(rid)
                reasons[rid] = FinishReason.ABORTED
            elif spec[10] == step and rid in s.requests:
                s.finish(rid, FinishReason.STOPPED)
                reasons[rid] = FinishReason.STOPPED
                if stopped_outside is not None:
                    stopped_outside.add(rid)


def held_tables(s: Scheduler) -> dict[str, list[int]]:
    """Every device block each running request holds: its table, and its window groups' tables (hybrid models)."""
    tables = {}
    for r in s.running:
        window = s.kv.window_table(r.request_id)
        tables[r.request_id] = s.kv.block_table(r.request_id) + (window.flat() if window is not None else [])
    return tables


def check_invariants(s: Scheduler, out: SchedulerOutput, cfg: CoreConfig, before: dict[str, list[int]]) -> None:
    bm = s.kv
    device_tables = held_tables(s)
    assert set(bm._tables) == set(device_tables), "a table outlived its request's RUNNING state"
    if bm.windows is not None:
        assert set(bm.windows.tables) == set(device_tables), "a window table outlived its request's RUNNING state"
    assert all(len(set(t)) == len(t) for t in device_tables.values()), "a table holds a block twice"
    held = Counter(b for t in device_tables.values() for b in t)
    refs = bm.device._refs
    assert all(r >= 0 for r in refs), "a negative reference count"
    assert all(refs[b] == c for b, c in held.items()), "a reference count differs from the tables holding it"
    assert sum(1 for r in refs if r > 0) == len(held)
    assert bm.device.num_free + len(held) == bm.device.num_blocks
    assert bm.device.free_blocks() == {b for b in range(bm.device.num_blocks) if refs[b] == 0}
    assert all(bm.device._keys[b] == k for k, b in bm.device._cached.items())
    for k, copies in bm.device._duplicates.items():  # held copies of a held primary, each keyed
        assert copies and refs[bm.device._cached[k]] > 0, "a duplicate of a free or missing primary"
        assert all(refs[b] > 0 and bm.device._keys[b] == k and b != bm.device._cached[k] for b in copies)
    keyed = [b for b, k in enumerate(bm.device._keys) if k is not None]
    assert len(keyed) == len(bm.device._cached) + sum(map(len, bm.device._duplicates.values())), "a stray key"
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


def update_and_record(s: Scheduler, out: SchedulerOutput, result: ExecutorResult, outputs: dict[str, list[int]],
                      reasons: dict[str, FinishReason]) -> None:
    """update() one step, adding each delta's tokens to outputs and its finish to reasons (a request gets
    nothing after its last delta), then check the running set's columns."""
    for d in s.update(out, result):
        assert reasons.get(d.request_id) is None, f"{d.request_id}: a delta after its last one"
        outputs[d.request_id] += d.new_token_ids
        if d.finish_reason is not None:
            reasons[d.request_id] = d.finish_reason
    check_columns(s)


def check_columns(s: Scheduler) -> None:
    """The RunningSet's rows say what the Request objects and the KV tables say (after every schedule and
    update): token counts, table capacity, stop columns, steps in flight, the running-order snapshot."""
    rs, order = s.rs, s.rs.order
    assert len(order.slots) == len(order.requests) == len(order.ids) == len(order.outputs) == len(order.works)
    slots = order.slots.tolist()
    assert len(set(slots)) == len(slots), "two running requests share a row"
    assert not set(slots) & set(rs._free_slots), "a running request's row is also free"
    assert len(slots) + len(rs._free_slots) == len(rs.num_tokens)
    for i, r in enumerate(order.requests):
        slot = slots[i]
        assert r.slot == slot and order.ids[i] == r.request_id and order.outputs[i] is r.output_token_ids
        work = order.works[i]
        assert work.request is r and work.num_tokens == 1 and work.new_block_ids == [] and not work.is_new
        opts = r.sampling
        assert rs.num_tokens[slot] == r.num_tokens, f"{r.request_id}: num_tokens column"
        assert rs.uncomputed[slot] == r.num_uncomputed_tokens, f"{r.request_id}: uncomputed column"
        assert 0 < r.num_uncomputed_tokens <= r.num_tokens
        assert rs.capacity[slot] == s.kv.num_slots(r.request_id), \
            f"{r.request_id}: capacity column"
        assert len(s.kv.block_table(r.request_id)) <= s.kv.usable_blocks, f"{r.request_id} outgrew the usable pool"
        # the stop columns, as the default stop table (stop_rules.STOP_RULES) derives them
        assert rs.limit[slot] == min(s.limits.max_model_len, r.num_prompt_tokens + opts.max_tokens)
        assert rs.watch[slot] == (bool(opts.stop_token_ids) or opts.min_tokens > 0 or not r.output_token_ids)
        assert [column[slot] for column in rs.listen] == ([not opts.ignore_eos] if s.limits.eos_token_ids else [])
        if s.kv.enable_caching:  # prompt blocks are registered as soon as they are computed
            assert s.kv._num_cached.get(r.request_id, 0) >= min(r.num_computed_tokens, r.num_prompt_tokens) // BLOCK, \
                f"{r.request_id}: a computed full prompt block is not in the prefix cache"
        in_flight = sum(any(w.request is r for w in out.scheduled) for out in s._unupdated)
        assert rs.inflight[slot] == in_flight, f"{r.request_id}: {rs.inflight[slot]} steps in flight, not {in_flight}"
    running = set(map(id, order.requests))
    assert all(r.slot == -1 for r in s.requests.values() if id(r) not in running)


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
