"""The C++ CPU paged-attention kernel (executor_service/attention/cpu.py) against the torch reference.

The kernel must build here (g++ and ninja; scripts/setup.sh builds it): these tests fail, not skip, when it
cannot, because the executor would then silently run the slower reference."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from executor_service.attention import ENV_VAR, cpu, get_attention_ops, reference
from executor_service.kernels import build as cpu_build
from executor_service.model import cpu_ops
from tests.executor.test_attention import (
    BATCHED_CASES,
    RAGGED_CONTEXTS,
    Batch,
    _poison_unused_slots,
    dense_attention,
    make_batch,
)
from tests.support.syntax_checks import SyntaxChecks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    assert cpu.load(), "the CPU attention kernel did not build (see the warning in the log)"


def args(batch: Batch) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]:
    return (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            batch.scale)


def kernel_only(batch: Batch, seqs: list[int] | None = None, out: Tensor | None = None,
                portable: bool = False) -> Tensor:
    """The raw op (or its portable path) over `seqs` (default: all), whatever their query length."""
    out = torch.full(batch.query.shape, 7.0) if out is None else out
    ids = torch.tensor(range(batch.seq_lens.shape[0]) if seqs is None else seqs, dtype=torch.int32)
    query, k_cache, v_cache, tables, lens, starts, scale = args(batch)
    op = torch.ops.pagedserve_cpu.paged_attention_portable if portable else torch.ops.pagedserve_cpu.paged_attention
    op(out, query, k_cache, v_cache, tables, lens, starts, ids, scale)
    return out


LONG_CASES = [
    pytest.param([(0, 40), (100, 17), (3, 1), (250, 16), (0, 1)], 16, 2, 4, 64, id="prefill-chunks-g4"),
    pytest.param([(ctx, 2) for ctx in RAGGED_CONTEXTS], 4, 3, 2, 80, id="two-token-steps-bs4"),
    pytest.param([(500, 1), (31, 33), (1, 1)], 1, 1, 8, 32, id="block-size-1-g8"),
]


@pytest.mark.parametrize(("seqs", "block_size", "kv_heads", "group", "head_dim"), BATCHED_CASES + LONG_CASES)
def test_kernel_matches_dense_and_reference(seqs: list[tuple[int, int]], block_size: int, kv_heads: int,
                                            group: int, head_dim: int) -> None:
    batch = make_batch(seqs, block_size, kv_heads, group, head_dim, torch.float32)
    dense = dense_attention(batch)
    real = batch.query_start_loc[-1].item()
    raw = kernel_only(batch)
    torch.testing.assert_close(raw[:real].double(), dense[:real], atol=1e-5, rtol=1e-5)
    split = cpu.paged_attention(*args(batch), scratch=reference.Scratch())
    torch.testing.assert_close(split.double(), dense, atol=1e-5, rtol=1e-5)
    expected = reference.paged_attention(*args(batch))
    torch.testing.assert_close(split, expected, atol=2e-6, rtol=2e-6)


# One key, partial last blocks, chunks of 16 keys that span blocks, causal chunks of several tokens (one over
# several row tiles), long contexts.
SHAPE_SEQS = [(0, 1), (1, 1), (15, 1), (16, 1), (17, 1), (40, 1), (100, 1), (0, 5), (23, 5), (31, 16), (10, 40),
              (64, 3), (300, 1)]
# Block size, KV heads, group, head size: 64/128 (constant-size tiles), 80/16 (run-time size), 24 (portable); the
# decode tiles' (head size, group) pairs: (64, 2), (64, 4), (128, 2), (32, 2), (32, 4), and AVX2's (over float16
# caches) also (64, 1), (128, 1), (128, 4).
SHAPES = [
    (16, 2, 2, 64), (16, 1, 4, 64), (8, 2, 1, 64), (32, 1, 8, 64), (16, 2, 4, 128), (8, 1, 8, 128), (32, 4, 1, 128),
    (16, 2, 2, 80), (8, 1, 4, 80), (32, 2, 1, 24), (16, 1, 8, 24), (16, 4, 2, 16), (8, 2, 2, 32), (16, 2, 2, 128),
    (8, 1, 4, 32),
]


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), SHAPES,
                         ids=[f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in SHAPES])
def test_both_paths_match_dense(block_size: int, kv_heads: int, group: int, head_dim: int, portable: bool) -> None:
    """The AVX-512 tile (where built) and the portable one, over every shape the model can send them."""
    batch = make_batch(SHAPE_SEQS, block_size, kv_heads, group, head_dim, torch.float32)
    _poison_unused_slots(batch, block_size)
    torch.testing.assert_close(kernel_only(batch, portable=portable).double(), dense_attention(batch), atol=1e-5,
                               rtol=1e-5)


def kernel_on_threads(batch: Batch, threads: int) -> torch.Tensor:
    """kernel_only(batch) with torch given `threads` threads (restored after)."""
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return kernel_only(batch)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_over_more_k_v_than_the_caches_hold_matches_dense(threads: int) -> None:
    """Over 8 MiB of K/V in one call (the decode tile then prefetches rows several chunks ahead of the one it
    computes, on into the V rows and the thread's next sequence), ragged contexts, at 1 and 2 threads."""
    contexts = [299, 300, 17, 1, 600, 16, 450, 333, 1500, 64, 287, 515]
    batch = make_batch([(ctx, 1) for ctx in contexts], 16, 4, 2, 64, torch.float32)
    assert batch.k_cache.element_size() * 2 * sum(contexts) * 4 * 64 > 8 << 20
    _poison_unused_slots(batch, 16)
    out = kernel_on_threads(batch, threads)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_lone_causal_prefill_split_by_cost_matches_dense(threads: int) -> None:
    """One long prompt (its later rows read the most keys) beside short sequences: the threads' runs of items are
    cut by cost, not count, and every row is computed once, as at one thread."""
    batch = make_batch([(0, 300), (5, 1), (40, 3)], 16, 2, 4, 64, torch.float32)
    _poison_unused_slots(batch, 16)
    out = kernel_on_threads(batch, threads)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_the_fast_path_is_built_where_the_cpu_has_avx512() -> None:
    flags = cpu_build.cpu_flags().split()
    assert torch.ops.pagedserve_cpu.has_avx512() == ("avx512f" in flags)


@pytest.mark.parametrize("source", [cpu.SOURCE, *cpu_ops.SOURCES], ids=lambda p: p.name)
def test_the_source_compiles_for_a_cpu_without_avx512(source: Path, syntax_checks: SyntaxChecks) -> None:
    """Builds elsewhere get only the portable attention tile (tested here through paged_attention_portable) and the
    skinny linear's AVX2 tile (x86-64-v3: AVX2 and FMA). The checks run in the background from the end of collection
    (tests/support/syntax_checks.py)."""
    returncode, stderr = syntax_checks.result(source)
    assert returncode == 0, stderr


def test_split_sends_long_chunks_behind_a_long_prefix_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """(prefix, queries): decodes, short chunks and long chunks that are mostly their own causal triangle (a
    prefix under a third of their length) take the kernel; long chunks behind a longer prefix take SDPA."""
    batch = make_batch([(10, 1), (0, 40), (20, 3), (40, 33), (5, 33), (11, 33)], 16, 2, 2, 32, torch.float32)
    split = cpu.plan_split(batch.query, batch.k_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    assert split.kernel_seqs is not None and split.kernel_seqs.tolist() == [0, 1, 2, 4]
    assert sum(g.num_seqs for g in split.plan.groups) == 2
    torch.testing.assert_close(cpu.paged_attention(*args(batch)), reference.paged_attention(*args(batch)),
                               atol=2e-6, rtol=2e-6)
    monkeypatch.setattr(cpu, "KERNEL_MAX_QUERY", 100)
    everything = cpu.plan_split(batch.query, batch.k_cache, batch.block_tables, batch.seq_lens,
                                batch.query_start_loc)
    assert everything.kernel_seqs is not None and everything.kernel_seqs.tolist() == [0, 1, 2, 3, 4, 5]
    assert everything.plan.groups == []
    torch.testing.assert_close(cpu.paged_attention(*args(batch)), reference.paged_attention(*args(batch)),
                               atol=2e-6, rtol=2e-6)


def test_kernel_writes_only_the_named_sequences() -> None:
    batch = make_batch([(12, 1), (40, 3), (7, 1)], 16, 2, 2, 32, torch.float32)
    out = kernel_only(batch, seqs=[1])
    starts = batch.query_start_loc.tolist()
    assert torch.equal(out[: starts[1]], torch.full_like(out[: starts[1]], 7.0))
    assert torch.equal(out[starts[2] :], torch.full_like(out[starts[2] :], 7.0))
    torch.testing.assert_close(out[starts[1] : starts[2]].double(), dense_attention(batch)[starts[1] : starts[2]],
                               atol=1e-5, rtol=1e-5)


def test_kernel_reads_no_slot_past_a_context() -> None:
    batch = make_batch([(ctx, 1) for ctx in RAGGED_CONTEXTS] + [(20, 7)], 16, 2, 2, 32, torch.float32)
    _poison_unused_slots(batch, 16)
    torch.testing.assert_close(kernel_only(batch).double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_kernel_takes_a_strided_query_as_the_model_passes_it() -> None:
    batch = make_batch([(30, 1), (0, 5), (64, 1)], 16, 2, 2, 32, torch.float32)
    wide = torch.randn(batch.query.shape[0], batch.query.shape[1] + 2, 32)
    wide[:, : batch.query.shape[1]] = batch.query
    strided = Batch(**{**batch.__dict__, "query": wide[:, : batch.query.shape[1]]})
    assert not strided.query.is_contiguous()
    torch.testing.assert_close(cpu.paged_attention(*args(strided)), cpu.paged_attention(*args(batch)), atol=0, rtol=0)


def test_kernel_is_deterministic_and_plans_once_per_step() -> None:
    batch = make_batch([(ctx, 1) for ctx in RAGGED_CONTEXTS], 16, 2, 2, 32, torch.float32)
    scratch = reference.Scratch()
    first = cpu.paged_attention(*args(batch), scratch=scratch)
    plan = scratch.plan((batch.block_tables, batch.seq_lens, batch.query_start_loc), lambda: None)
    assert plan is not None
    assert torch.equal(cpu.paged_attention(*args(batch), scratch=scratch), first)


def test_kernel_gives_the_same_bits_on_any_number_of_threads() -> None:
    """Each sequence is computed whole by one thread, so intra-op threads change nothing."""
    batch = make_batch([(ctx, 1) for ctx in RAGGED_CONTEXTS] + [(9, 12)], 16, 2, 2, 32, torch.float32)
    assert torch.equal(kernel_on_threads(batch, 1), kernel_on_threads(batch, 2))


def test_other_dtypes_go_to_the_reference() -> None:
    batch = make_batch([(12, 1), (0, 9)], 16, 2, 2, 32, torch.bfloat16)
    assert torch.equal(cpu.paged_attention(*args(batch)), reference.paged_attention(*args(batch)))
    halves = make_batch([(12, 1), (0, 9)], 16, 2, 2, 32, torch.float16)  # float16 queries (a float16 model)
    assert not cpu.supports(halves.query, halves.k_cache)
    assert torch.equal(cpu.paged_attention(*args(halves)), reference.paged_attention(*args(halves)))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize("position", [3, 17], ids=["among-8-keys", "in-the-tail"])
def test_a_nan_key_gives_its_heads_nan_wherever_it_sits(position: int, portable: bool,
                                                        cache_dtype: torch.dtype) -> None:
    """A NaN key (a float16 cache stores a key beyond 65,504 as inf, whose scores can be NaN) makes the rows of its
    KV head NaN, as the reference does, whether it falls among the keys whose exponentials are taken 8 at a time
    (the first 16 of 21) or after them (the last 5): never a finite output that hides it."""
    batch = make_batch([(20, 1)], 16, 2, 2, 64, torch.float32)
    batch = Batch(**{**batch.__dict__, "k_cache": batch.k_cache.to(cache_dtype),
                     "v_cache": batch.v_cache.to(cache_dtype)})
    block = int(batch.block_tables[0, position // 16])
    batch.k_cache[block, position % 16, 0] = float("nan")  # KV head 0: query heads 0 and 1
    out = kernel_only(batch, portable=portable)
    assert bool(out[0, :2].isnan().all()) and not bool(out[0, 2:].isnan().any())
    assert torch.equal(out.isnan(), reference.paged_attention(*args(batch)).isnan())


def one_decode_row(context: int, magnitude: float, cache_dtype: torch.dtype,
                   gen: torch.Generator) -> tuple[Tensor, ...]:
    """A decode step of one sequence (2 KV heads, group 2, head size 64, one block) with a query of `magnitude`:
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs."""
    k_cache = torch.randn(1, 16, 2, 64, generator=gen).to(cache_dtype)
    v_cache = torch.randn(1, 16, 2, 64, generator=gen).to(cache_dtype)
    query = torch.randn(1, 4, 64, generator=gen) * magnitude
    return (query, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([context], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))


def dense_row(query: Tensor, k_cache: Tensor, v_cache: Tensor, visible: int) -> Tensor:
    """One query token's attention [4 heads, 64] over the first `visible` keys of one_decode_row's block, in float64."""
    keys = k_cache[0, :visible].double().repeat_interleave(2, dim=1)  # [visible, 4 query heads, 64]
    values = v_cache[0, :visible].double().repeat_interleave(2, dim=1)
    weights = torch.softmax(torch.einsum("thd,hd->ht", keys, query.double()) * 0.1, dim=-1)
    return torch.einsum("ht,thd->hd", weights, values)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
def test_huge_scores_weigh_the_largest_alone_and_one_key_gives_its_value_exactly(portable: bool,
                                                                                 cache_dtype: torch.dtype) -> None:
    """The largest score's exponent is exactly 0 in every tile (decode rows, and two query tokens for the general
    tiles): the decode tiles subtract the row's maximum from the stored scaled scores. With the product fused into
    that subtraction (GCC contracts it into an FMA) the largest kept its rounding error, which can be positive:
    finite scores of 1e9 and more then gave wrong weights or inf / inf (NaN), and a single key its value off by an
    ulp."""
    gen = torch.Generator().manual_seed(0)
    op = torch.ops.pagedserve_cpu.paged_attention_portable if portable else torch.ops.pagedserve_cpu.paged_attention
    for magnitude in (1e9, 1e12, 1e30):
        for _ in range(20):
            query, k_cache, v_cache, tables, lens, starts, seqs = one_decode_row(16, magnitude, cache_dtype, gen)
            out = torch.zeros_like(query)
            op(out, query, k_cache, v_cache, tables, lens, starts, seqs, 0.1)
            torch.testing.assert_close(out[0].double(), dense_row(query[0], k_cache, v_cache, 16), atol=1e-6, rtol=0)
    for _ in range(20):  # two query tokens: the general tiles (online softmax), the last two of 16 positions
        query, k_cache, v_cache, tables, lens, starts, seqs = one_decode_row(16, 1e12, cache_dtype, gen)
        query = torch.cat([query, torch.randn(1, 4, 64, generator=gen) * 1e12])
        out = torch.zeros_like(query)
        op(out, query, k_cache, v_cache, tables, lens, torch.tensor([0, 2], dtype=torch.int32), seqs, 0.1)
        for token, visible in ((0, 15), (1, 16)):
            torch.testing.assert_close(out[token].double(), dense_row(query[token], k_cache, v_cache, visible),
                                       atol=1e-6, rtol=0)
    for magnitude in (1.0, 1e3):
        for _ in range(50):
            query, k_cache, v_cache, tables, lens, starts, seqs = one_decode_row(1, magnitude, cache_dtype, gen)
            out = torch.zeros_like(query)
            op(out, query, k_cache, v_cache, tables, lens, starts, seqs, 0.1)
            assert torch.equal(out[0], v_cache[0, 0].float().repeat_interleave(2, dim=0))


def float16_cache(batch: Batch) -> Batch:
    """`batch` with its caches in float16 (--kv-cache-dtype float16) and its keys and values as they are stored."""
    return Batch(**{**batch.__dict__, "k_cache": batch.k_cache.half(), "v_cache": batch.v_cache.half(),
                    "keys": [k.half().float() for k in batch.keys],
                    "values": [v.half().float() for v in batch.values]})


@pytest.mark.parametrize("portable", [False, True], ids=["fast", "portable"])
@pytest.mark.parametrize(("block_size", "kv_heads", "group", "head_dim"), SHAPES[::2],
                         ids=[f"bs{b}-kv{k}-g{g}-d{d}" for b, k, g, d in SHAPES[::2]])
def test_a_float16_cache_is_read_as_the_float32_values_it_holds(block_size: int, kv_heads: int, group: int,
                                                                head_dim: int, portable: bool) -> None:
    """Both tiles over a float16 cache: attention over the stored (rounded) keys and values, as the reference
    computes it (the reference widens the gathered rows), in float32 throughout."""
    batch = float16_cache(make_batch(SHAPE_SEQS, block_size, kv_heads, group, head_dim, torch.float32))
    _poison_unused_slots(batch, block_size)
    raw = kernel_only(batch, portable=portable)
    torch.testing.assert_close(raw.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)
    assert cpu.supports(batch.query, batch.k_cache)
    expected = reference.paged_attention(*args(batch))
    torch.testing.assert_close(cpu.paged_attention(*args(batch), scratch=reference.Scratch()), expected, atol=2e-6,
                               rtol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_decode_over_a_float16_cache_larger_than_the_caches_matches_dense(threads: int) -> None:
    """The prefetching decode paths over float16 rows (a line holds 32 of them): over 8 MiB of K/V in one call."""
    contexts = [299, 300, 17, 1, 600, 16, 450, 333, 1500, 64, 287, 515, 2000, 1200, 900]
    batch = float16_cache(make_batch([(ctx, 1) for ctx in contexts], 16, 4, 2, 64, torch.float32))
    assert batch.k_cache.element_size() * 2 * sum(contexts) * 4 * 64 > 8 << 20
    _poison_unused_slots(batch, 16)
    out = kernel_on_threads(batch, threads)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_mismatched_shapes() -> None:
    batch = make_batch([(12, 1)], 16, 2, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="k/v caches differ"):
        kernel_only(Batch(**{**batch.__dict__, "v_cache": batch.v_cache.half()}))
    with pytest.raises(RuntimeError, match="float32 or float16"):
        kernel_only(Batch(**{**batch.__dict__, "k_cache": batch.k_cache.double(), "v_cache": batch.v_cache.double()}))
    with pytest.raises(RuntimeError, match="disagree"):
        kernel_only(batch, out=torch.empty(batch.query.shape[0], batch.query.shape[1], 16))
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.pagedserve_cpu.paged_attention(torch.empty_like(batch.query), batch.query, batch.k_cache,
                                                 batch.v_cache, batch.block_tables.long(), batch.seq_lens,
                                                 batch.query_start_loc, torch.zeros(1, dtype=torch.int32), 1.0)


def test_kernel_refuses_metadata_that_would_read_outside_the_cache() -> None:
    batch = make_batch([(12, 1), (30, 2)], 16, 2, 2, 32, torch.float32)
    short_lens = batch.seq_lens.clone()
    short_lens[1] = 0  # fewer context tokens than query tokens
    bad_block = batch.block_tables.clone()
    bad_block[1, 0] = batch.k_cache.shape[0]
    long_lens = batch.seq_lens.clone()
    long_lens[0] = 16 * batch.block_tables.shape[1] + 1
    for changed, match in [({"seq_lens": short_lens}, "query tokens but context"),
                           ({"block_tables": bad_block}, "block id"),
                           ({"seq_lens": long_lens}, "blocks, table has")]:
        with pytest.raises(RuntimeError, match=match):
            kernel_only(Batch(**{**batch.__dict__, **changed}))
    with pytest.raises(RuntimeError, match="out of range"):
        kernel_only(batch, seqs=[2])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("skip", [True, False], ids=["with-skipped-slot", "all-mapped"])
def test_write_kv_equals_the_reference(skip: bool, cache_dtype: torch.dtype) -> None:
    """Into a float16 cache, rounded to nearest even as torch's .to(torch.float16) (over 8 floats at a time and
    the rest one by one: a head size of 20)."""
    gen = torch.Generator().manual_seed(3)
    shape = (6, 4, 2, 20)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(2))
    slots = torch.randperm(24, generator=gen)[:7]
    slot_mapping = torch.cat([slots, torch.tensor([-1])]) if skip else slots
    qkv = torch.randn(len(slot_mapping), 3, 2, 20, generator=gen) * 1e3  # strided K/V, as the model passes them
    key, value = qkv[:, 1], qkv[:, 2]
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_expected, v_expected, slot_mapping)
    cpu.write_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu.write_kv(key, value, k_cache, v_cache, torch.full_like(slot_mapping, 24))


def test_the_executor_gets_the_kernel_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    write, attend = get_attention_ops("cpu")
    assert write is cpu.write_kv and isinstance(attend, functools.partial) and attend.func is cpu.paged_attention
    monkeypatch.setenv(ENV_VAR, "cpu")
    assert get_attention_ops("cpu")[0] is cpu.write_kv


def test_without_a_compiler_the_executor_falls_back_to_the_reference(tmp_path: Path) -> None:
    """A fresh kernel directory and no working compiler: a warning, the reference ops, and `=cpu` refuses."""
    code = (
        "import executor_service.attention as a\n"
        "from executor_service.attention import reference\n"
        "w, p = a.get_attention_ops('cpu')\n"
        "assert w is reference.write_kv and p.func is reference.paged_attention\n"
        "import os; os.environ['PAGEDSERVE_ATTENTION'] = 'cpu'\n"
        "try:\n    a.get_attention_ops('cpu')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
    )
    env = {**os.environ, "PAGEDSERVE_KERNEL_DIR": str(tmp_path), "CXX": "/bin/false", "PYTHONPATH": str(ROOT)}
    env.pop(ENV_VAR, None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert "CPU attention kernel unavailable" in done.stderr
    assert "refused: PAGEDSERVE_ATTENTION=cpu" in done.stdout


def test_a_prebuilt_library_loads_without_a_compiler_and_a_broken_or_locked_one_is_built(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The Docker image ships kernels built in its build stage and no g++ or ninja: the executor must load them as
    they are; a library that does not load is built again."""
    from torch.utils import cpp_extension

    monkeypatch.setenv(cpu_build.KERNEL_DIR_ENV, str(tmp_path))
    sources = [tmp_path / "op.cpp"]
    sources[0].write_text("// a source\n")
    library = tmp_path / f"ext-{cpu_build.build_key(sources, cpu_build.CFLAGS)}" / "ext.so"
    loaded: list[str] = []
    compiled: list[str] = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda name, **_: compiled.append(name))
    cpu_build.build_extension("ext", sources)  # nothing built yet: compiles
    assert compiled == ["ext"] and loaded == []
    library.write_bytes(b"\x7fELF")  # what a finished build leaves
    cpu_build.build_extension("ext", sources)
    assert compiled == ["ext"] and loaded == [str(library)]

    def broken(path: str) -> None:
        raise OSError(f"{path}: invalid ELF header")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    cpu_build.build_extension("ext", sources)  # removed, so that ninja links it again rather than keep it
    assert compiled == ["ext", "ext"] and "building it again" in caplog.text and not library.exists()
    library.write_bytes(b"\x7fELF")
    (library.parent / "lock").touch()  # another process is building it: it may be half linked
    cpu_build.build_extension("ext", sources)
    assert compiled == ["ext", "ext", "ext"] and library.exists()


def test_every_kernel_source_ships_as_package_data() -> None:
    """The Docker image and any pip install build the kernels from the installed package, so every C++ source and
    shared header must be listed as package data of the package that holds it."""
    import tomllib
    from fnmatch import fnmatch

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    packages = {Path(*name.split(".")): patterns for name, patterns in data.items() if name != "*"}
    for source in [cpu.SOURCE, *cpu_ops.SOURCES, *cpu_build.SHARED_HEADERS.glob("*.h")]:
        path = source.relative_to(ROOT)
        assert any(fnmatch(str(path.relative_to(package)), pattern)
                   for package, patterns in packages.items() if path.is_relative_to(package)
                   for pattern in patterns), f"{path} is not package data in pyproject.toml"
