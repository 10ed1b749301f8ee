"""The executor's fast forward path: RoPE without temporaries, the per-step attention plan, CUDA-graph flags."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from executor_service.attention import reference
from executor_service.config import ExecutorConfig, parse_sizes
from executor_service.model.llama import apply_rope


def hf_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's formula with the concatenated tables."""
    half = x.shape[-1] // 2
    cos2, sin2 = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos2 + rotated * sin2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_identical_to_hugging_face_on_strided_rows(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, (4 + 2 + 2) * 16, generator=gen).to(dtype)
    qk = qkv[:, : 6 * 16].view(7, 6, 16)  # q and k heads of a fused qkv output: row stride > row length
    freqs = torch.randn(7, 8, generator=gen) * 3
    cos, sin = freqs.cos().to(dtype)[:, None], freqs.sin().to(dtype)[:, None]
    assert torch.equal(apply_rope(qk, cos, sin), hf_rope(qk.contiguous(), cos, sin))


def decode_batch(lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // 4) for n in lens)
    cache = torch.randn(2, blocks + 2, 4, 2, 8, generator=gen)
    tables = torch.arange(blocks + 2, dtype=torch.int32)[: blocks].view(-1, 1)
    table_rows, start = [], 0
    for n in lens:
        count = -(-n // 4)
        table_rows.append(torch.nn.functional.pad(tables[start : start + count, 0], (0, 8 - count)))
        start += count
    query = torch.randn(len(lens), 4, 8, generator=gen)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    return query, cache[0], cache[1], torch.stack(table_rows), torch.tensor(lens, dtype=torch.int32), qsl


def test_plan_is_built_once_per_step_and_rebuilt_for_the_next() -> None:
    scratch = reference.Scratch()
    query, k, v, tables, lens, qsl = decode_batch([5, 9, 16], seed=1)
    first = reference.paged_attention(query, k, v, tables, lens, qsl, 0.3, scratch)
    plan: reference.Plan = scratch.plan((tables, lens, qsl), lambda: pytest.fail("the same step must reuse its plan"))
    layer2 = reference.paged_attention(query * 2, k, v, tables, lens, qsl, 0.3, scratch)  # next layer, same step
    torch.testing.assert_close(layer2, reference.paged_attention(query * 2, k, v, tables, lens, qsl, 0.3))
    assert scratch.plan((tables, lens, qsl), lambda: pytest.fail("rebuilt")) is plan
    lens2 = torch.tensor([6, 10, 17], dtype=torch.int32)  # the next step: new metadata tensors
    second = reference.paged_attention(query, k, v, tables, lens2, qsl, 0.3, scratch)
    torch.testing.assert_close(second, reference.paged_attention(query, k, v, tables, lens2, qsl, 0.3))
    assert not torch.equal(first, second)


def test_cuda_graph_sizes_flag() -> None:
    assert parse_sizes("8,1, 2,8") == (1, 2, 8)
    assert parse_sizes("") == ()
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes("0,4")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_sizes("four")
    assert ExecutorConfig.from_args(["--cuda-graph-sizes", "4,2"]).cuda_graph_sizes == (2, 4)
    assert ExecutorConfig.from_args([]).cuda_graph_sizes == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_decode_matches_eager() -> None:
    from executor_service.backend import BatchItem, SamplingConfig
    from executor_service.runner.torch_backend import TorchBackend

    config = ExecutorConfig(device="cuda", num_gpu_blocks=256, num_cpu_blocks=0)
    eager = TorchBackend.create(config)
    config.cuda_graph_sizes = (1, 4, 8)
    graphed = TorchBackend.create(config)
    assert graphed.graphs is not None
    greedy = SamplingConfig(temperature=0.0)
    for n in (1, 3, 8, 9):  # 3 pads to 4; 9 is larger than every graph and runs eagerly
        tokens = []
        for backend in (eager, graphed):
            ids = [[5 + i + j for j in range(20)] for i in range(n)]
            tables = [list(range(i * 3, i * 3 + 3)) for i in range(n)]
            backend.execute([BatchItem(str(i), ids[i], 20, 0, 20, tables[i], True, greedy) for i in range(n)])
            for _ in range(5):
                outs = backend.execute([BatchItem(str(i), ids[i], 20, len(ids[i]) - 1, 1, tables[i], True, greedy)
                                        for i in range(n)])
                for i, o in enumerate(outs):
                    ids[i].append(o.token_id)  # type: ignore[union-attr]
            tokens.append(ids)
        assert tokens[0] == tokens[1]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=["float32-cache", "float16-cache"])
def test_fused_rope_and_kv_write_are_bit_identical_to_the_torch_path(cache_dtype: torch.dtype) -> None:
    """Into a float16 cache (--kv-cache-dtype float16) the rotated keys and the values are rounded as torch's
    .to(torch.float16) rounds them."""
    from executor_service.attention import cpu as attention_cpu
    from executor_service.attention import reference
    from executor_service.model import cpu_ops

    if not cpu_ops.load() or not attention_cpu.load():
        pytest.skip("the C++ CPU ops cannot be built here")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, tokens = 4, 2, 16, 9
    wide = torch.randn(tokens, (heads + 2 * kv_heads) * dim + 7, generator=gen)
    qkv = wide[:, 3 : 3 + (heads + 2 * kv_heads) * dim]  # strided rows, as a split of a wider output
    freqs = torch.randn(tokens, dim // 2, generator=gen) * 3
    cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
    slots = torch.tensor([5, 0, -1, 17, 3, 30, 12, 8, 1])  # -1: not written
    k_cache, v_cache = (torch.randn(8, 4, kv_heads, dim, generator=gen).to(cache_dtype) for _ in range(2))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), cos, sin)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    reference.write_kv(qk[:, heads:], v, k_expected, v_expected, slots)
    q = cpu_ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, torch.full((tokens,), 32), heads, kv_heads)
    with pytest.raises(RuntimeError, match="qkv"):
        cpu_ops.rope_write_kv(qkv[:, :-dim], cos, sin, k_cache, v_cache, slots, heads, kv_heads)


def test_fused_rms_norms_match_torch_and_add_the_residual_in_place() -> None:
    from executor_service.model import cpu_ops

    if not cpu_ops.load():
        pytest.skip("the C++ CPU ops cannot be built here")
    gen = torch.Generator().manual_seed(6)
    hidden = 80  # one 64-wide vector block and a scalar tail
    wide = torch.randn(11, hidden + 5, generator=gen) * 4
    x = wide[:, 2 : 2 + hidden]  # strided rows
    residual = torch.randn(11, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    expected_sum = residual + x
    expected = torch.nn.functional.rms_norm(expected_sum, (hidden,), weight, 1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5),
                               torch.nn.functional.rms_norm(x, (hidden,), weight, 1e-5), rtol=2e-6, atol=2e-6)
    out = cpu_ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the add is exact, in place
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)
    assert out.is_contiguous() and out.data_ptr() != residual.data_ptr()
    with pytest.raises(RuntimeError, match="rows"):
        cpu_ops.add_rms_norm(x[:5], residual, weight, 1e-5)
    with pytest.raises(RuntimeError, match="residual"):
        cpu_ops.add_rms_norm(x, residual[:, :-1], weight, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_ops.rms_norm(x, weight.double(), 1e-5)


def test_fused_silu_and_mul_matches_torch_over_the_whole_range() -> None:
    from executor_service.model import cpu_ops

    if not cpu_ops.load():
        pytest.skip("the C++ CPU ops cannot be built here")
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 2 * 45 + 3, generator=gen) * 6  # 45: vectors (16 or 8 lanes) and a scalar tail
    wide[0, 1:10] = torch.tensor([-1e4, -104.0, -88.0, -20.0, 0.0, 20.0, 88.0, 104.0, 1e4])  # exp's range ends
    # where e^-g outgrows float32 (g / (1 + e^-g) a tiny negative, then -0) and the specials, in one vector
    wide[1, 1:12] = torch.tensor([-88.6, -88.4, -100.0, -1e30, -3.4e38, -math.inf, math.nan, 88.5, 1e30, math.inf,
                                  -88.2])
    wide[1, 46:57] = 1e30  # their up: a product that would show any error the SiLU leaves
    gate_up = wide[:, 1 : 1 + 2 * 45]  # strided rows
    gate, up = gate_up.split(45, dim=-1)
    out = cpu_ops.silu_and_mul(gate_up)
    assert out.shape == (9, 45) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=1e-6, atol=1e-30, equal_nan=True)
    assert torch.equal(out.signbit(), (torch.nn.functional.silu(gate) * up).signbit())
    with pytest.raises(RuntimeError, match="even"):
        cpu_ops.silu_and_mul(gate_up[:, :-1])


def test_layers_with_fused_ops_match_the_torch_ops() -> None:
    """The model's residual stream (each layer's output added by the next layer's norm) gives the same hidden
    states with the C++ norms and activation as with torch's, up to rounding."""
    from executor_service.backend import BatchItem, SamplingConfig
    from executor_service.model import cpu_ops
    from executor_service.model.llama import MLP, RMSNorm
    from executor_service.runner.torch_backend import TorchBackend

    if not cpu_ops.load():
        pytest.skip("the C++ CPU ops cannot be built here")
    backend = TorchBackend.create(ExecutorConfig(device="cpu", num_gpu_blocks=64, num_cpu_blocks=0))
    norms = [m for m in backend.model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(n.fused_add_norm is cpu_ops.add_rms_norm for n in norms)
    items = [BatchItem(str(i), list(range(3 + i, 40 + 2 * i)), 37 + i, 0, 37 + i, [4 * i, 4 * i + 1, 4 * i + 2],
                       True, SamplingConfig(temperature=0.0)) for i in range(3)]
    batch = backend.prepare(items)
    fused = backend.run_batch(batch)
    for norm in norms:
        norm.fused_norm = norm.fused_add_norm = None
    for mlp in (m for m in backend.model.modules() if isinstance(m, MLP)):
        assert mlp.fused_silu_and_mul is cpu_ops.silu_and_mul
        mlp.fused_silu_and_mul = None
    plain = backend.run_batch(backend.prepare(items))
    assert fused is not None and plain is not None
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
