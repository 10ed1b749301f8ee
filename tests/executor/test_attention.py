import functools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from executor_service.attention import (
    ENV_VAR,
    PagedAttentionFn,
    WriteKVFn,
    get_attention_ops,
    reference,
    triton_paged,
)

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# On a GPU machine: PAGEDSERVE_TEST_DEVICE=cuda TRITON_INTERPRET=0 runs the kernels compiled for real.
DEVICE = torch.device(os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu"))


@dataclass
class Batch:
    query: Tensor
    k_cache: Tensor
    v_cache: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    keys: list[Tensor]
    values: list[Tensor]
    scale: float


def _build_block_tables(seq_lens: list[int], block_size: int, gen: torch.Generator) -> tuple[Tensor, int]:
    needed = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(needed) + 3
    ids = torch.randperm(num_blocks, generator=gen)[: sum(needed)]
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int32)
    start = 0
    for s, count in enumerate(needed):
        table[s, :count] = ids[start : start + count]
        start += count
    return table, num_blocks


def _slots(table_row: Tensor, positions: Tensor, block_size: int) -> Tensor:
    return table_row.long()[positions // block_size] * block_size + positions % block_size


SCRATCHED = functools.partial(reference.paged_attention, scratch=reference.Scratch())


def make_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
) -> Batch:
    """seqs: (cached context length, query length) per sequence."""
    gen = torch.Generator().manual_seed(len(seqs) * 1000 + block_size * 10 + group)
    seq_lens = [ctx + q for ctx, q in seqs]
    table, num_blocks = _build_block_tables(seq_lens, block_size, gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in seq_lens]
    for s, n in enumerate(seq_lens):
        reference.write_kv(
            keys[s], values[s], k_cache, v_cache, _slots(table[s], torch.arange(n), block_size)
        )
    q_lens = torch.tensor([q for _, q in seqs])
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    return Batch(
        query=query,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=query_start_loc,
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


def dense_attention(batch: Batch) -> Tensor:
    """Naive causal attention from the unpacked per-sequence K/V, in float64."""
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    starts = batch.query_start_loc.tolist()
    for s, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[s] : starts[s + 1]].double()
        group = q.shape[1] // key.shape[1]
        k = key.double().repeat_interleave(group, dim=1)
        v = value.double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(key.shape[0] - q.shape[0], key.shape[0])
        mask = torch.arange(key.shape[0])[None, :] <= q_pos[:, None]
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=batch.scale
        )
        out[starts[s] : starts[s + 1]] = attended.transpose(0, 1)
    return out


def run_attention(fn: PagedAttentionFn, batch: Batch) -> Tensor:
    """Run on DEVICE; the output comes back to the CPU."""
    tensors = (batch.query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc)
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc = (t.to(DEVICE) for t in tensors)
    return fn(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, batch.scale).cpu()


CASES = [
    pytest.param([(0, 5), (37, 1), (3, 6), (61, 4)], 4, 2, 1, 16, torch.float32, id="mixed-bs4-g1-fp32"),
    pytest.param([(0, 40), (17, 1), (30, 3), (5, 1)], 16, 1, 2, 32, torch.float16, id="mixed-bs16-g2-fp16"),
    pytest.param([(12, 1), (40, 1), (15, 1)], 16, 2, 4, 32, torch.float32, id="decode-bs16-g4-fp32"),
    pytest.param([(0, 9), (26, 21)], 4, 1, 4, 16, torch.float16, id="prefill-bs4-g4-fp16"),
    pytest.param([(2, 3), (45, 1), (0, 17)], 4, 2, 2, 16, torch.bfloat16, id="mixed-bs4-g2-bf16"),
    pytest.param([(19, 2), (20, 0), (0, 1), (33, 1)], 16, 2, 2, 24, torch.float32, id="odd-dim-empty-seq"),
]


@pytest.mark.parametrize(("seqs", "block_size", "kv_heads", "group", "head_dim", "dtype"), CASES)
def test_reference_matches_dense(
    seqs: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_batch(seqs, block_size, kv_heads, group, head_dim, dtype)
    out = run_attention(reference.paged_attention, batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


RAGGED_CONTEXTS = [0, 1, 14, 15, 16, 17, 31, 47, 63, 64, 100, 129, 255]
BATCHED_CASES = [
    pytest.param([(ctx, 1) for ctx in RAGGED_CONTEXTS], 16, 4, 1, 32, id="decode-ragged-g1"),
    pytest.param([(ctx, 1) for ctx in RAGGED_CONTEXTS], 16, 2, 2, 64, id="decode-ragged-g2"),
    pytest.param([(ctx, 1) for ctx in reversed(RAGGED_CONTEXTS)], 4, 1, 4, 16, id="decode-ragged-g4-bs4"),
    pytest.param([(37, 1), (5, 20), (16, 1), (0, 1), (3, 13), (90, 1), (0, 33)], 16, 2, 2, 32, id="mixed-g2"),
    pytest.param([(7, 9), (64, 1), (0, 0), (18, 1), (0, 16), (33, 5), (1, 1)], 8, 1, 4, 24, id="mixed-g4-empty"),
    pytest.param([(30, 1), (2, 1), (61, 3), (17, 1), (200, 1), (9, 1)], 16, 4, 1, 16, id="mixed-g1-mid-block"),
    pytest.param([(0, 48), (16, 16), (5, 40)], 16, 2, 4, 32, id="prefill-g4"),
]
DTYPE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("chunk_bytes", [1 << 21, 4096, 1], ids=["one-chunk", "few-chunks", "chunk-per-seq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("seqs", "block_size", "kv_heads", "group", "head_dim"), BATCHED_CASES)
def test_batched_reference_matches_dense(
    monkeypatch: pytest.MonkeyPatch,
    seqs: list[tuple[int, int]],
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    chunk_bytes: int,
) -> None:
    monkeypatch.setattr(reference, "CHUNK_BYTES", chunk_bytes)
    batch = make_batch(seqs, block_size, kv_heads, group, head_dim, dtype)
    out = run_attention(SCRATCHED, batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = DTYPE_TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=tol, rtol=tol)


def _poison_unused_slots(batch: Batch, block_size: int) -> None:
    used = torch.zeros(batch.k_cache.shape[0] * block_size, dtype=torch.bool)
    for s, n in enumerate(batch.seq_lens.tolist()):
        used[_slots(batch.block_tables[s], torch.arange(n), block_size)] = True
    batch.k_cache.view(used.shape[0], -1)[~used] = float("nan")
    batch.v_cache.view(used.shape[0], -1)[~used] = float("nan")


@pytest.mark.parametrize("seqs", [[(ctx, 1) for ctx in RAGGED_CONTEXTS], [(3, 1), (20, 7), (40, 1)]])
def test_reference_ignores_slots_past_each_context(seqs: list[tuple[int, int]]) -> None:
    batch = make_batch(seqs, 16, 2, 2, 32, torch.float32)
    _poison_unused_slots(batch, 16)
    out = run_attention(SCRATCHED, batch)
    torch.testing.assert_close(out.double(), dense_attention(batch), atol=1e-5, rtol=1e-5)


def test_reference_outputs_survive_later_calls() -> None:
    first = make_batch([(ctx, 1) for ctx in RAGGED_CONTEXTS], 16, 2, 2, 32, torch.float32)
    out = run_attention(SCRATCHED, first)
    expected = out.clone()
    run_attention(SCRATCHED, make_batch([(300, 1), (5, 9)] * 8, 16, 2, 2, 32, torch.float32))
    assert torch.equal(out, expected)


@pytest.mark.parametrize(("seqs", "block_size", "kv_heads", "group", "head_dim", "dtype"), CASES)
def test_triton_matches_reference(
    seqs: list[tuple[int, int]], block_size: int, kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    batch = make_batch(seqs, block_size, kv_heads, group, head_dim, dtype)
    expected = run_attention(reference.paged_attention, batch)
    out = run_attention(triton_paged.paged_attention, batch)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs Triton compiling for a GPU")
def test_decode_steps_of_any_batch_size_and_table_width_share_one_compiled_kernel() -> None:
    """Each new class of a specialised argument (an integer: 1, a multiple of 16, other; a pointer: 16-byte aligned
    or not) costs a compile of ~1 s in the middle of serving. The metadata come from the executor's own decode
    batch builder (one packed upload, viewed), as in serving. tests/executor/test_triton_specialization.py checks
    the same on the CPU."""
    from executor_service.backend import BackendInfo, BatchItem, SamplingConfig
    from executor_service.runner.torch_backend import build_decode_batch

    kernel = triton_paged._paged_attention_kernel
    compiled: int | None = None
    for num_seqs in (1, 5, 16, 17, 32):
        for context in (3, 40, 230):  # tables 1, 3 and 15 - 17 blocks wide
            batch = make_batch([(context + i, 1) for i in range(num_seqs)], 16, 2, 2, 32, torch.float16)
            seq_lens = batch.seq_lens.tolist()
            info = BackendInfo("m", vocab_size=1, eos_token_ids=(), max_model_len=4096, block_size=16,
                               num_device_blocks=batch.k_cache.shape[0], num_swap_blocks=0, dtype="float16",
                               device="cuda")
            items = [BatchItem(str(i), [0] * n, 1, n - 1, 1, batch.block_tables[i].tolist(), True, SamplingConfig())
                     for i, n in enumerate(seq_lens)]
            step = build_decode_batch(items, info, DEVICE)
            assert step is not None
            meta = step.meta
            out = triton_paged.paged_attention(batch.query.to(DEVICE), batch.k_cache.to(DEVICE),
                                               batch.v_cache.to(DEVICE), meta.block_tables, meta.seq_lens,
                                               meta.query_start_loc, batch.scale).cpu()
            expected = run_attention(reference.paged_attention, batch)
            torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)
            count = sum(len(caches[0]) for caches in kernel.device_caches.values())
            compiled = count if compiled is None else compiled
            assert count == compiled, f"a new compile at {num_seqs} sequences of {context}+ tokens"


@pytest.mark.parametrize("skip", [True, False], ids=["with-skipped-slot", "all-mapped"])
@pytest.mark.parametrize("write_fn", [reference.write_kv, triton_paged.write_kv], ids=["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_touches_only_mapped_slots(write_fn: WriteKVFn, dtype: torch.dtype, skip: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, kv_heads, head_dim = 6, 4, 2, 16
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:7]
    slot_mapping = torch.cat([slots, torch.tensor([-1])]) if skip else slots
    key = torch.randn(len(slot_mapping), kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(len(slot_mapping), kv_heads, head_dim, generator=gen).to(dtype)

    on_device = [t.to(DEVICE) for t in (key, value, k_cache, v_cache, slot_mapping)]
    write_fn(*on_device)
    k_cache, v_cache = on_device[2].cpu(), on_device[3].cpu()

    k_expected = k_before.view(-1, kv_heads, head_dim).clone()
    v_expected = v_before.view(-1, kv_heads, head_dim).clone()
    k_expected[slots] = key[:7]
    v_expected[slots] = value[:7]
    assert torch.equal(k_cache.view(-1, kv_heads, head_dim), k_expected)
    assert torch.equal(v_cache.view(-1, kv_heads, head_dim), v_expected)


def is_reference(ops: tuple[object, object]) -> bool:
    write, attend = ops
    return write is reference.write_kv and getattr(attend, "func", None) is reference.paged_attention


def test_get_attention_ops_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert is_reference(get_attention_ops("meta"))  # the CPU gets the C++ kernel: tests/executor/test_attention_cpu.py
    monkeypatch.setenv(ENV_VAR, "triton")
    assert get_attention_ops("cpu") == (triton_paged.write_kv, triton_paged.paged_attention)
    monkeypatch.setenv(ENV_VAR, "reference")
    assert is_reference(get_attention_ops(torch.device("cuda")))
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError):
        get_attention_ops("cpu")


def test_package_import_does_not_import_triton() -> None:
    code = "import sys, executor_service.attention; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_tiny_model_forward_through_the_triton_kernel_matches_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel inside the model (under TRITON_INTERPRET=1 on the CPU): a prefill and two decodes of a
    one-layer model give the reference path's logprobs and tokens. Tiny, because the interpreter is slow."""
    from executor_service.backend import BatchItem, SamplingConfig
    from executor_service.config import ExecutorConfig
    from executor_service.default_model.model import make_model
    from executor_service.runner.torch_backend import TorchBackend

    path = make_model(tmp_path / "tiny", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64,
                      init_std=0.2, seed=9)
    config = ExecutorConfig(model=str(path), device=DEVICE.type, dtype="float32", block_size=4, num_gpu_blocks=8,
                            num_cpu_blocks=2)
    sampling = SamplingConfig(temperature=0.0, logprobs=2)

    def run(kernel: str) -> list[tuple[int, float]]:
        monkeypatch.setenv(ENV_VAR, kernel)
        backend = TorchBackend.create(config)
        tokens = [5, 9, 17, 33, 2, 40]
        prompt_len, out, start, n = len(tokens), [], 0, len(tokens)
        for _ in range(3):
            item = BatchItem("r", list(tokens), prompt_len, start, n, [0, 1, 2], True, sampling)
            sample = backend.execute([item])[0]
            assert sample is not None and sample.logprob is not None
            out.append((sample.token_id, sample.logprob))
            start, n = len(tokens), 1
            tokens.append(sample.token_id)
        return out

    reference_path, triton_path = run("reference"), run("triton")
    assert [t for t, _ in triton_path] == [t for t, _ in reference_path]
    assert [lp for _, lp in triton_path] == pytest.approx([lp for _, lp in reference_path], abs=1e-4)
