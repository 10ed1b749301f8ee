"""The layers' lean loop (model/lean_layers.py, #29): taken for a plain Llama on the CPU's fused kernels, its hidden
states bit-identical to the modules' at every kind of step (one row: F.linear; a few: the skinny kernel; many:
the packed GEMM; prefill and decode mixed), and not taken where a layer is not plain or the step is not a plain one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.model import LlamaForCausalLM, ModelConfig
from executor_service.model.llama import AttentionMetadata
from executor_service.runner.torch_backend import TorchBackend, build_batch, model_ops

GREEDY = SamplingConfig(temperature=0.0)
BLOCK = 16


@pytest.fixture(scope="module")
def backend() -> Iterator[TorchBackend]:
    created = TorchBackend.create(ExecutorConfig(device="cpu", num_gpu_blocks=256, num_cpu_blocks=0))
    created.wait_for_packing()
    yield created


def item(rid: int, length: int, start: int, sample: bool = True) -> BatchItem:
    tokens = [3 + (rid * 7 + i * 13) % 200 for i in range(length)]
    table = list(range(rid * 4, rid * 4 + 4))  # up to 64 tokens
    return BatchItem(str(rid), tokens, length, start, length - start, table, sample, GREEDY)


def hidden_both_ways(backend: TorchBackend, items: list[BatchItem]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's hidden states for one step, through the lean loop and through the modules (the same K/V is
    written both times)."""
    model, lean = backend.model, backend.model.lean
    batch = build_batch(items, backend.info, backend.device)
    layers = backend.kv_cache.layers
    with torch.inference_mode():
        fast = model(batch.input_ids, batch.positions, batch.meta, layers, batch.rows_to_keep())
        model.lean = None
        try:
            modules = model(batch.input_ids, batch.positions, batch.meta, layers, batch.rows_to_keep())
        finally:
            model.lean = lean
    return fast, modules


def test_a_plain_llama_on_the_fused_kernels_takes_the_lean_loop(backend: TorchBackend) -> None:
    assert backend.model.lean is not None
    assert len(backend.model.lean.layers) == backend.model.config.num_layers


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_decode_steps_are_bit_identical_to_the_modules(backend: TorchBackend, rows: int) -> None:
    prompts = [item(i, 20 + i, 0, sample=False) for i in range(rows)]
    backend.execute(prompts)  # their context in the cache
    decode = [item(i, 21 + i, 20 + i) for i in range(rows)]
    fast, modules = hidden_both_ways(backend, decode)
    assert fast.shape == (rows, backend.model.config.hidden_size)
    assert torch.equal(fast, modules)


def test_prefill_and_mixed_steps_are_bit_identical_to_the_modules(backend: TorchBackend) -> None:
    backend.execute([item(0, 30, 0, sample=False)])
    mixed = [item(0, 31, 30), item(1, 64, 0), item(2, 64, 0), item(3, 64, 16)]  # decode, prompts, a later chunk
    skinny_rows = max(linear.packed.skinny_rows for linear in backend.model.packable_linears() if linear.packed)
    assert sum(i.num_tokens for i in mixed) > skinny_rows  # the packed GEMM's rows, not the skinny kernel's
    fast, modules = hidden_both_ways(backend, mixed)
    assert torch.equal(fast, modules)
    assert not torch.equal(fast[0], fast[1])


def test_the_lean_loop_changes_no_greedy_token(backend: TorchBackend) -> None:
    items = [item(i, 12 + 5 * i, 0) for i in range(4)]
    lean = backend.model.lean
    with_lean = backend.execute(items)
    backend.model.lean = None
    try:
        without = backend.execute(items)
    finally:
        backend.model.lean = lean
    assert [s.token_id for s in with_lean if s] == [s.token_id for s in without if s]


def tiny_config(**features: object) -> ModelConfig:
    return ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
                                  "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "num_hidden_layers": 2, "rms_norm_eps": 1e-6,
                                  "max_position_embeddings": 128, **features})


def build(cfg: ModelConfig) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, model_ops(torch.device("cpu"), torch.float32), device=torch.device("cpu"),
                            dtype=torch.float32)


def test_layers_that_are_not_plain_keep_the_modules() -> None:
    assert build(tiny_config()).lean is not None
    assert build(tiny_config(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=8)).lean is None
    assert build(tiny_config(model_type="gemma2", architectures=["Gemma2ForCausalLM"], head_dim=8,
                             query_pre_attn_scalar=8, sliding_window=16)).lean is None
    assert build(tiny_config(model_type="olmo2", architectures=["Olmo2ForCausalLM"])).lean is None
    float64 = LlamaForCausalLM(tiny_config(), model_ops(torch.device("cpu"), torch.float64),
                               device=torch.device("cpu"), dtype=torch.float64)
    assert float64.lean is None  # no fused kernels for it


def test_biases_and_a_query_scale_go_through_the_lean_loop_unchanged() -> None:
    """A Qwen2-like layer (biased q/k/v) and biased o_proj and MLP, prefill and decode: bit-identical to the modules."""
    cfg = tiny_config(attention_bias=True, mlp_bias=True)
    model = build(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    assert model.lean is not None and model.lean.layers[0].qkv.bias is not None
    caches = [(torch.zeros(4, BLOCK, 2, 8), torch.zeros(4, BLOCK, 2, 8)) for _ in range(cfg.num_layers)]
    lens = [5, 7]
    ids = torch.randint(3, 64, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([torch.arange(n) + BLOCK * i for i, n in enumerate(lens)])
    meta = AttentionMetadata(slots, torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                             torch.tensor([0, 5, 12], dtype=torch.int32))
    lean = model.lean
    with torch.inference_mode():
        fast = model(ids, positions, meta, caches)
        model.lean = None
        modules = model(ids, positions, meta, caches)
    assert torch.equal(fast, modules) and bool(torch.isfinite(fast).all())
    assert lean is not None and lean.layers[0].o.bias is not None
