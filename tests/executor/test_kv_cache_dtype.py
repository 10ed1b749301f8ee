"""--kv-cache-dtype float16 (#29): the KV cache in float16 under a float32 model on the CPU, as llama.cpp keeps its
cache by default. Twice the blocks in the same memory; keys and values rounded as they are written (the C++ writes
and the torch reference's agree bit for bit, tests/executor/test_attention_cpu.py); the model's outputs close to
the float32 cache's; the lean loop, swaps and a draft model's cache work on it; a GPU refuses it under another
model dtype."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.runner.kv_cache import CacheShape, KVCache
from executor_service.runner.torch_backend import TorchBackend, build_batch, resolve_kv_cache_dtype

GREEDY = SamplingConfig(temperature=0.0)
KV_GIB = 0.02


def create(kv_cache_dtype: str, **settings: object) -> TorchBackend:
    backend = TorchBackend.create(ExecutorConfig(device="cpu", cpu_kv_cache_space=KV_GIB, swap_space=KV_GIB / 2,
                                                 kv_cache_dtype=kv_cache_dtype, **settings))  # type: ignore[arg-type]
    backend.wait_for_packing()
    return backend


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, TorchBackend]]:
    yield {"auto": create("auto"), "float16": create("float16")}


def item(rid: int, length: int, start: int, sample: bool = True) -> BatchItem:
    tokens = [3 + (rid * 7 + i * 13) % 200 for i in range(length)]
    table = list(range(rid * 4, rid * 4 + 4))  # up to 64 tokens
    return BatchItem(str(rid), tokens, length, start, length - start, table, sample, GREEDY)


def hidden(backend: TorchBackend, items: list[BatchItem]) -> torch.Tensor:
    batch = build_batch(items, backend.info, backend.device)
    with torch.inference_mode():
        return backend.model(batch.input_ids, batch.positions, batch.meta, backend.kv_cache.layers,
                             batch.rows_to_keep())


def test_auto_is_the_models_dtype_and_a_gpu_takes_float16_only_under_a_float16_model() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == torch.float32
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu) == torch.float16
    assert resolve_kv_cache_dtype("float16", torch.bfloat16, cpu) == torch.float16  # the reference reads it
    assert resolve_kv_cache_dtype("float16", torch.float16, cuda) == torch.float16
    with pytest.raises(ValueError, match=r"--kv-cache-dtype float16: on a GPU .* \(bfloat16\)"):
        resolve_kv_cache_dtype("float16", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="--kv-cache-dtype must be auto or float16, got 'fp8'"):
        resolve_kv_cache_dtype("fp8", torch.float32, cpu)


def test_the_flag_parses_and_a_value_it_does_not_take_is_a_usage_error_naming_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert ExecutorConfig.from_args(["--kv-cache-dtype", "float16"]).kv_cache_dtype == "float16"
    assert ExecutorConfig.from_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        ExecutorConfig.from_args(["--kv-cache-dtype", "fp8"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


def test_a_float16_cache_holds_twice_the_blocks_in_the_same_memory(backends: dict[str, TorchBackend]) -> None:
    wide, half = backends["auto"].kv_cache, backends["float16"].kv_cache
    assert wide.device_kv.dtype == torch.float32 and half.device_kv.dtype == torch.float16
    assert half.swap_kv.dtype == torch.float16
    assert half.num_device_blocks // 2 == wide.num_device_blocks  # each the most whole blocks in KV_GIB
    assert half.num_swap_blocks // 2 == wide.num_swap_blocks
    assert wide.device_kv.nbytes <= half.device_kv.nbytes <= KV_GIB * 2**30
    assert backends["float16"].info.num_device_blocks == half.num_device_blocks  # what the scheduler is told


def test_the_float16_cache_holds_the_rounded_keys_and_the_outputs_stay_close(
        backends: dict[str, TorchBackend]) -> None:
    """The same prompts and decode step on both caches: the first layer's keys and values (from the embeddings)
    are the float32 cache's, rounded; the later layers' and the hidden states differ (the rounding is real) but by
    little, and no greedy token changes."""
    prompts = [item(i, 20 + 3 * i, 0, sample=False) for i in range(4)]
    decode = [item(i, 21 + 3 * i, 20 + 3 * i) for i in range(4)]
    states = {}
    for name, backend in backends.items():
        backend.execute(prompts)
        states[name] = hidden(backend, decode)
    wide, half = backends["auto"].kv_cache.device_kv, backends["float16"].kv_cache.device_kv
    used = slice(0, 16)  # the four requests' blocks
    assert torch.equal(half[0, :, used], wide[0, :, used].half())
    torch.testing.assert_close(half[1:, :, used].float(), wide[1:, :, used], atol=2e-2, rtol=2e-2)
    assert not torch.equal(states["float16"], states["auto"])
    torch.testing.assert_close(states["float16"], states["auto"], atol=2e-2, rtol=2e-2)
    tokens = {name: [s.token_id for s in backend.execute(decode) if s] for name, backend in backends.items()}
    assert tokens["float16"] == tokens["auto"]


def test_the_lean_loop_is_bit_identical_to_the_modules_over_a_float16_cache(
        backends: dict[str, TorchBackend]) -> None:
    backend = backends["float16"]
    model, lean = backend.model, backend.model.lean
    assert lean is not None
    backend.execute([item(5, 30, 0, sample=False)])
    step = [item(5, 31, 30), item(6, 40, 0)]
    fast = hidden(backend, step)
    model.lean = None
    try:
        modules = hidden(backend, step)
    finally:
        model.lean = lean
    assert torch.equal(fast, modules)


def test_swapped_float16_blocks_come_back_bit_for_bit() -> None:
    shape = CacheShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    cache = KVCache(shape, num_device_blocks=6, num_swap_blocks=3, device=torch.device("cpu"))
    cache.device_kv.copy_(torch.randn(cache.device_kv.shape, generator=torch.Generator().manual_seed(1)))
    before = cache.device_kv.clone()
    cache.swap_out([(1, 0), (4, 2)])
    cache.device_kv.zero_()
    cache.swap_in([(0, 3), (2, 5)])
    assert torch.equal(cache.device_kv[:, :, 3], before[:, :, 1])
    assert torch.equal(cache.device_kv[:, :, 5], before[:, :, 4])


def test_a_draft_model_runs_in_the_models_dtype_over_a_float16_cache(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pagedserve.executor")
    model = make_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=64,
                       init_std=0.2)
    backend = TorchBackend.create(ExecutorConfig(model=str(model), draft_model=str(model), device="cpu",
                                                 block_size=4, num_gpu_blocks=32, num_cpu_blocks=0,
                                                 kv_cache_dtype="float16"))
    draft = backend.draft
    assert draft is not None
    assert draft.kv_cache.device_kv.dtype == torch.float16
    assert {p.dtype for p in draft.model.parameters()} == {torch.float32}
    out = backend.execute([BatchItem("a", [1, 2, 3, 4, 5], 5, 0, 5, [0, 1], True, GREEDY)])
    assert out[0] is not None
    assert "KV cache in float16: 32 device and 0 swap blocks" in caplog.text  # the log says what the cache holds
