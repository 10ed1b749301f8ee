"""A hybrid model's sliding-window KV cache groups in the pure core: window blocks go back to the pool once no
query reads them, prefix hits count only where the window's blocks are cached, and random traces against the
KV-checking executor model (which reads window layers through their own tables and drops released blocks
itself) keep every invariant, read no released block and produce an undisturbed run's tokens."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from protos.contract import released_before, ring_blocks
from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.kv_cache_manager import KVCacheManager, PrefixHit
from scheduler_service.core.policy import Policy
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import (
    BLOCK,
    EOS,
    EOS2,
    TRACE_SPEC,
    FakeClock,
    TraceSpec,
    check_columns,
    check_invariants,
    config_spec,
    end_trace_requests,
    held_tables,
    max_model_len_spec,
    request_spec,
    run_step,
    trace_limits,
    update_and_record,
)
from tests.support.model_executor import ModelExecutor
from tests.support.trace_outputs import TraceOutputs, check_trace_outputs, reshape


def hybrid_limits(device_blocks: int, cpu_blocks: int, groups: int, window: int,
                  max_model_len: int = 96, ring: bool = False, only: bool = False) -> ExecutorLimits:
    return ExecutorLimits(BLOCK, device_blocks, cpu_blocks, max_model_len=max_model_len,
                          eos_token_ids=(EOS, EOS2), max_num_draft_tokens=4, num_window_groups=groups, window=window,
                          window_ring=ring or only, window_only=only)


def run_alone(prompt_len: int, max_tokens: int, window: int, groups: int = 1, ring: bool = False,
              only: bool = False, **cfg: object) -> tuple[Scheduler, list[int], int]:
    """One request through a hybrid (or window-only) scheduler and the executor model: the scheduler, its tokens,
    and the most blocks one window group held at once."""
    s = Scheduler(CoreConfig(**cfg), hybrid_limits(200, 0, groups, window, 512, ring, only))  # type: ignore[arg-type]
    ex = ModelExecutor(200, 1, BLOCK, window_groups=groups, window=window, window_ring=ring or only,
                       window_only=only)
    r = Request("a", list(range(5, 5 + prompt_len)), SamplingOptions(max_tokens=max_tokens, ignore_eos=True), 0.0)
    s.add_request(r)
    tokens: list[int] = []
    peak = 0
    while s.has_unfinished():
        out = s.schedule()
        table = s.kv.window_table("a")
        peak = max(peak, table.length if table is not None else 0)
        for d in s.update(out, ex.step(out)):
            tokens += d.new_token_ids
    return s, tokens, peak


def test_a_long_request_holds_the_window_not_the_length() -> None:
    window = 8
    s, tokens, peak = run_alone(prompt_len=30, max_tokens=60, window=window, max_num_batched_tokens=4)
    assert len(tokens) == 60
    # a step of at most 4 tokens after the window's 7 keys: ceil((7 + 4) / 4) + 1 blocks at most, not 90 / 4
    assert peak <= -(-(window - 1 + 4) // BLOCK) + 1
    assert s.kv.device.num_free == 200


def test_decode_holds_at_most_ceil_window_over_block_plus_one() -> None:
    window = 9
    _, _, peak = run_alone(prompt_len=3, max_tokens=80, window=window)  # decode only, after a 3-token prefill
    assert peak <= -(-window // BLOCK) + 1


def test_a_ring_holds_the_bound_while_prefill_chunks_run() -> None:
    """Rings: chunks longer and shorter than the window, then decode; a window group never holds more than
    ceil(window / block_size) + 1 blocks, and the executor model reads every window intact."""
    window = 9
    for chunk in (3, 8, 30):
        s, tokens, peak = run_alone(prompt_len=70, max_tokens=40, window=window, ring=True,
                                    max_num_batched_tokens=chunk)
        assert len(tokens) == 40 and peak == ring_blocks(window, BLOCK) == 4
        assert s.kv.device.num_free == 200
    # tables released block by block hold the window and the chunk's blocks while a long chunk runs
    _, _, released_peak = run_alone(prompt_len=70, max_tokens=40, window=window, max_num_batched_tokens=30)
    assert released_peak > ring_blocks(window, BLOCK)


def test_a_ring_model_gets_no_prefix_hits() -> None:
    """A ring's blocks are overwritten in place: never cached, so no hit (the full group's alone is no use)."""
    kv = KVCacheManager(64, 0, BLOCK, watermark=0.0, window_groups=1, window=6, window_ring=True)
    a = Request("a", list(range(5, 29)), SamplingOptions(), 0.0)
    kv.admit(a, PrefixHit(), a.num_tokens)
    assert kv.window_table("a").length == ring_blocks(6, BLOCK) == 3  # type: ignore[union-attr]
    a.num_computed_tokens = 24
    kv.cache_blocks(a)
    kv.free(a)
    assert kv.get_computed_blocks(Request("b", [*range(5, 29), 99], SamplingOptions(), 0.0)).num_tokens == 0
    assert kv.device.num_free == 64


def test_a_window_only_model_holds_its_ring_whatever_the_length() -> None:
    """Every layer slides (Capabilities.kv_window_only): no full-attention table at all, the one window group's
    ring is all a request holds, prefill chunks shorter and longer than the window and decode included; the
    executor model reads every window intact and is sent no block table."""
    window = 9
    for chunk in (3, 8, 30):
        s, tokens, peak = run_alone(prompt_len=150, max_tokens=60, window=window, only=True,
                                    max_num_batched_tokens=chunk)
        assert len(tokens) == 60 and peak == ring_blocks(window, BLOCK) == 4
        assert s.kv.device.num_free == 200 and s.kv.window_only


def test_a_window_only_request_longer_than_the_pool_fits() -> None:
    """12 device blocks hold a ring of 4: a request of 400 tokens (100 blocks of positions) runs; the block table
    stays empty and the ring's capacity covers any length."""
    kv = KVCacheManager(12, 0, BLOCK, watermark=0.0, window_groups=1, window=9, window_ring=True, window_only=True)
    assert not kv.never_fits(400)
    s = Scheduler(CoreConfig(max_num_batched_tokens=16), hybrid_limits(12, 0, 1, 9, 512, only=True))
    ex = ModelExecutor(12, 1, BLOCK, window_groups=1, window=9, window_ring=True, window_only=True)
    s.add_request(Request("a", list(range(5, 405)), SamplingOptions(max_tokens=20, ignore_eos=True), 0.0))
    tokens: list[int] = []
    while s.has_unfinished():
        out = s.schedule()
        assert s.kv.block_table("a") == [] and s.kv.num_blocks_held("a") <= ring_blocks(9, BLOCK)
        for d in s.update(out, ex.step(out)):
            tokens += d.new_token_ids
    assert len(tokens) == 20 and s.kv.device.num_free == 12
    # a pool that cannot hold one ring bounds a request by the blocks it holds: 3 blocks, 12 positions
    small = KVCacheManager(3, 0, BLOCK, watermark=0.0, window_groups=1, window=9, window_ring=True, window_only=True)
    assert not small.never_fits(12) and small.never_fits(13)


def test_a_window_only_request_swaps_its_ring() -> None:
    kv = KVCacheManager(16, 8, BLOCK, watermark=0.0, window_groups=1, window=9, window_ring=True, window_only=True)
    a = Request("a", list(range(5, 45)), SamplingOptions(), 0.0)
    kv.admit(a, PrefixHit(), a.num_tokens)
    ring = kv.window_table("a")
    assert ring is not None and ring.length == 4 and kv.block_table("a") == []
    a.num_computed_tokens = 40
    mapping = kv.swap_out(a)
    assert [src for src, _ in mapping] == ring.flat() and kv.device.num_free == 16
    assert kv.can_swap_in("a", 41)
    back = kv.swap_in(a)
    after = kv.window_table("a")
    assert after is not None and [dst for _, dst in back] == after.flat() and kv.block_table("a") == []
    assert kv.num_slots("a") >= 10_000 * BLOCK  # a full ring covers every position
    kv.free(a)
    kv.end_step()
    assert kv.device.num_free == 16 and kv.cpu.num_free == 8


def test_full_group_keeps_every_block() -> None:
    s = Scheduler(CoreConfig(max_num_batched_tokens=8), hybrid_limits(200, 0, 2, 4, 512))
    s.add_request(Request("a", list(range(5, 45)), SamplingOptions(max_tokens=5, ignore_eos=True), 0.0))
    ex = ModelExecutor(200, 1, BLOCK, window_groups=2, window=4)
    for _ in range(5):
        s.update(out := s.schedule(), ex.step(out))
    computed = s.requests["a"].num_computed_tokens
    table = s.kv.window_table("a")
    assert table is not None and len(table.groups) == 2
    assert len(s.kv.block_table("a")) == 10  # the whole prompt, allocated at admission
    assert table.start == released_before(computed - 8, 4, BLOCK)  # released up to the step before the last
    assert table.end <= -(-computed // BLOCK)


def test_prefix_hit_needs_the_windows_blocks() -> None:
    kv = KVCacheManager(64, 0, BLOCK, watermark=0.0, window_groups=1, window=6)
    a = Request("a", list(range(5, 29)), SamplingOptions(), 0.0)  # 24 tokens: 6 full blocks
    kv.admit(a, PrefixHit(), a.num_tokens)
    a.num_computed_tokens = 24
    kv.cache_blocks(a)
    b = Request("b", [*range(5, 29), 99], SamplingOptions(), 0.0)
    hit = kv.get_computed_blocks(b)
    assert hit.num_tokens == 24 and hit.window is not None
    assert hit.window.start == released_before(24, 6, BLOCK) == 4  # positions 19..23 are read: blocks 4 and 5
    assert hit.window.groups == [kv.window_table("a").groups[0][4:6]]  # type: ignore[union-attr]
    # a releases its window blocks but for the last two: they stay cached, so the hit stays
    kv.release_window(a)
    assert kv.get_computed_blocks(b).num_tokens == 24
    # evict the window block of position 5 (allocate every free block): the hit falls back to where the window
    # before it is cached, which is nowhere here
    kv.free(a)
    assert kv.device.allocate(kv.device.num_free) is not None
    assert kv.get_computed_blocks(b).num_tokens == 0


def test_swap_keeps_window_tables() -> None:
    kv = KVCacheManager(64, 32, BLOCK, watermark=0.0, window_groups=2, window=5)
    a = Request("a", list(range(5, 25)), SamplingOptions(), 0.0)
    kv.admit(a, PrefixHit(), a.num_tokens)
    a.num_computed_tokens = 20
    before = kv.window_table("a")
    assert before is not None
    kv.release_window(a)
    start, groups = before.start, [list(g) for g in before.groups]
    held = kv.block_table("a") + before.flat()
    mapping = kv.swap_out(a)
    assert [src for src, _ in mapping] == held and kv.window_table("a") is None
    assert len(mapping) == 5 + 2 * len(groups[0]) and start == released_before(20, 5, BLOCK) == 4
    assert kv.can_swap_in("a", 21)
    back = kv.swap_in(a)
    after = kv.window_table("a")
    assert after is not None and after.start == start and after.length == len(groups[0])
    assert [dst for _, dst in back] == kv.block_table("a") + after.flat()
    kv.free(a)
    kv.end_step()
    assert kv.device.num_free == 64 and kv.cpu.num_free == 32


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=12), cfg_kwargs=config_spec,
       device_blocks=st.integers(8, 60), cpu_blocks=st.integers(0, 40), max_model_len=max_model_len_spec,
       groups=st.sampled_from([1, 2, 3]), window=st.sampled_from([1, 3, 5, 8, 13]),
       seed=st.integers(0, 2**16), lose_at=st.sampled_from([0, 0, 3, 10, 25]), ring=st.booleans())
@example(  # two n = 2 siblings in rings, chunks shorter than a block: they took turns preempting themselves
    specs=[(5, 25, 5, 1, False, 0, 2, 2, 0, 0, 0)],
    cfg_kwargs={"policy": Policy.SJF, "preemption_mode": PreemptionMode.SWAP, "preemption_victim": Victim.LONGEST,
                "max_num_seqs": 4, "max_num_batched_tokens": 8, "num_lookahead_slots": 1,
                "enable_chunked_prefill": True, "long_prefill_token_threshold": 3, "watermark": 0.0,
                "enable_prefix_caching": True, "speculative_config": TRACE_SPEC},
    device_blocks=26, cpu_blocks=0, max_model_len=96, groups=2, window=13, seed=0, lose_at=0, ring=True)
def test_random_hybrid_traces_keep_invariants_and_tokens(specs: list[TraceSpec], cfg_kwargs: dict[str, object],
                                                         device_blocks: int, cpu_blocks: int, max_model_len: int,
                                                         groups: int, window: int, seed: int, lose_at: int,
                                                         ring: bool) -> None:
    """Both kinds of window tables; with rings, no request's window group ever holds more than R blocks."""
    limits = hybrid_limits(device_blocks, cpu_blocks, groups, window, max_model_len, ring)
    run_trace(specs, CoreConfig(**cfg_kwargs), limits, seed, lose_at)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_spec, min_size=1, max_size=12), cfg_kwargs=config_spec,
       device_blocks=st.integers(4, 12), cpu_blocks=st.integers(0, 30), max_model_len=max_model_len_spec,
       window=st.sampled_from([1, 5, 8, 13]), seed=st.integers(0, 2**16),
       lose_at=st.sampled_from([0, 0, 3, 10, 25]))
def test_random_window_only_traces_keep_invariants_and_tokens(specs: list[TraceSpec], cfg_kwargs: dict[str, object],
                                                              device_blocks: int, cpu_blocks: int,
                                                              max_model_len: int, window: int, seed: int,
                                                              lose_at: int) -> None:
    """Every layer slides (Capabilities.kv_window_only): one window group's ring and no block table; the same
    invariants, tokens and ring bound, with pools small enough that requests wait, swap and recompute."""
    limits = hybrid_limits(device_blocks, cpu_blocks, 1, window, max_model_len, only=True)
    s = run_trace(specs, CoreConfig(**cfg_kwargs), limits, seed, lose_at)  # type: ignore[arg-type]
    assert not s.kv._tables or not any(s.kv._tables.values())


def run_trace(specs: list[TraceSpec], cfg: CoreConfig, limits: ExecutorLimits, seed: int,
              lose_at: int) -> Scheduler:
    """A random trace against the KV-checking executor model: invariants every step, no released block read, the
    undisturbed run's tokens at the end; with rings, no window group ever holds more than R blocks."""
    device_blocks, cpu_blocks, groups, window = (limits.num_device_blocks, limits.num_swap_blocks,
                                                 limits.num_window_groups, limits.window)
    ring, only = limits.window_ring, limits.window_only
    clock = FakeClock()
    s = Scheduler(cfg, limits, clock=clock)
    ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23, window_groups=groups, window=window,
                       window_ring=ring, window_only=only)
    rng = random.Random(seed)
    trace = TraceOutputs()
    released = 0
    for step in range(800):
        clock.now = step * 0.01
        trace.add_arrivals(s, specs, step, clock.now)
        end_trace_requests(s, specs, step, trace.reasons, trace.stopped_outside)
        before = held_tables(s)
        out = s.schedule()
        check_invariants(s, out, cfg, before)
        check_columns(s)
        leaving = set(out.finished_ids) | set(out.swapped_out_ids)
        executor_held = {b for rid, st_ in ex.states.items() if rid not in leaving for b in ex._blocks_of(st_)}
        assert all(s.kv.device.ref_count(b) > 0 for b in executor_held), "the executor still reads a released block"
        released += sum(t.start for t in s.kv.windows.tables.values()) if s.kv.windows else 0
        if ring and s.kv.windows is not None:
            assert max((t.length for t in s.kv.windows.tables.values()), default=0) <= ring_blocks(window, BLOCK)
        if step == lose_at:
            s.reset_executor()
            s.set_executor_limits(limits)
            ex = ModelExecutor(device_blocks, cpu_blocks, BLOCK, eos=EOS, eos_every=23, window_groups=groups,
                               window=window, window_ring=ring, window_only=only)
            for rejected in out.rejected:
                trace.reasons[rejected.request_id] = FinishReason.ERROR
            continue
        result = reshape(ex.step(out), rng, trace.errors)
        update_and_record(s, out, result, trace.outputs, trace.reasons)
        if step > max(sp[0] for sp in specs) and not s.has_unfinished():
            break
    event(f"window blocks released while running: {released > 0}")
    event(f"prefix cache hits: {s.stats().prefix_cache_hits > 0}")
    stats = s.stats()
    event(f"preempted: {stats.num_preemptions_swap + stats.num_preemptions_recompute > 0}")
    check_trace_outputs(s, trace, limits)
    return s


def test_the_priority_policy_preempts_nobody_for_a_request_that_fits() -> None:
    """The blocks kept free for a running prefill's next window chunk hold back FCFS admissions only: a priority
    admission that fits the pool preempts nobody (it did, and then did not even admit, with the reserve counted)."""
    for pool in (140, 144):
        limits = replace(trace_limits(pool, 0, 4096), num_window_groups=2, window=8)
        s = Scheduler(CoreConfig(policy=Policy.PRIORITY, max_num_batched_tokens=64, long_prefill_token_threshold=32,
                                 watermark=0.0, enable_prefix_caching=False), limits, clock=FakeClock())
        s.add_request(Request("low", [5, 6, 7, 8], SamplingOptions(max_tokens=50, ignore_eos=True, priority=5), 0.0))
        s.add_request(Request("high", [9 + k % 30 for k in range(400)], SamplingOptions(max_tokens=2, priority=0),
                              0.0))
        for step in range(300):
            if step == 2:
                s.add_request(Request("w", [40 + k for k in range(8)], SamplingOptions(max_tokens=2, priority=1), 0.0))
            out = s.schedule()
            assert out.num_preempted == 0, (pool, step)
            s.update(out, run_step(out))
            if not s.has_unfinished():
                break
        assert not s.has_unfinished()
