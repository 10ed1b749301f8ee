"""The decoder layers of a plain Llama-like model as one loop over their tensors (#29).

A decode step of a few sequences on the CPU spends about 1 ms of Python on the modules' generality (module calls,
parameter lookups, the family switches of each layer: some 1,000 Python calls a step) while its kernels take
5 - 10 ms, and the second thread waits through all of it. Where every layer is Llama's own (norms before each
block, no q/k norm, no window, soft-capping or sinks, a dense SiLU MLP, one rank) and the fused CPU kernels are
loaded, LeanLayers runs the same kernels in the same order over tensors gathered once: the hidden states are
bit-identical to the modules' (tests/executor/test_lean_layers.py). The linears still go through `dense`, which
reads each one's packing as it is now (the packing after ready swaps it between steps). The loop takes the kernels
when it is built: patching Linear.forward, an Attention's ops or packed.dense afterwards does not reach it; patch its
own `dense` and `paged_attention` (as benchmarks/forward_steps.py --split does), or set the model's `lean` to None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from torch import Tensor

from executor_service.model.packed import dense

if TYPE_CHECKING:
    from executor_service.model.llama import MLP, AttentionMetadata, DecoderLayer, KVCaches, ModelOps
    from executor_service.model.parallel import Linear


@dataclass(frozen=True, slots=True)
class LeanLinear:
    """A linear's weight and bias, and the module, whose packing dense() reads at each call."""

    weight: Tensor
    bias: Tensor | None
    module: Linear

    @classmethod
    def of(cls, module: Linear) -> LeanLinear:
        return cls(module.weight, module.bias, module)


@dataclass(frozen=True, slots=True)
class LeanLayer:
    input_norm: Tensor
    post_attention_norm: Tensor
    qkv: LeanLinear
    o: LeanLinear
    gate_up: LeanLinear
    down: LeanLinear

    @classmethod
    def of(cls, layer: DecoderLayer) -> LeanLayer:
        attention, mlp = layer.self_attn, cast("MLP", layer.mlp)  # is_plain checked it
        return cls(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                   LeanLinear.of(attention.qkv_proj), LeanLinear.of(attention.o_proj),
                   LeanLinear.of(mlp.gate_up_proj), LeanLinear.of(mlp.down_proj))


class LeanLayers:
    """Built by LlamaForCausalLM.lean_layers, which checks that the layers are plain and the fused ops there."""

    def __init__(self, layers: Sequence[DecoderLayer], ops: ModelOps, eps: float) -> None:
        if not (ops.rope_write_kv and ops.rms_norm and ops.add_rms_norm and ops.silu_and_mul):
            raise ValueError("LeanLayers needs the fused RoPE, RMSNorm and SiLU kernels")
        self.rope_write_kv, self.rms_norm = ops.rope_write_kv, ops.rms_norm
        self.add_rms_norm, self.silu_and_mul = ops.add_rms_norm, ops.silu_and_mul
        self.paged_attention = ops.paged_attention
        self.dense = dense  # (benchmarks/forward_steps.py --split times it, and paged_attention, here)
        attention = layers[0].self_attn
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.q_size, self.scale, self.eps = attention.q_size, attention.scale, eps
        self.layers = [LeanLayer.of(layer) for layer in layers]

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, kv_caches: KVCaches,
            meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """The last layer's output and the residual stream it is yet to be added to, from the embeddings x."""
        eps, num_tokens, add_rms_norm = self.eps, x.shape[0], self.add_rms_norm
        residual = x
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = self.rms_norm(x, layer.input_norm, eps) if i == 0 else add_rms_norm(x, residual, layer.input_norm, eps)
            q = self.rope_write_kv(self.linear(layer.qkv, h), cos, sin, k_cache, v_cache, meta.slot_mapping,
                                   self.num_heads, self.num_kv_heads)
            out = self.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       self.scale)
            h = add_rms_norm(self.linear(layer.o, out.reshape(num_tokens, self.q_size)), residual,
                             layer.post_attention_norm, eps)
            x = self.linear(layer.down, self.silu_and_mul(self.linear(layer.gate_up, h)))
        return x, residual

    def linear(self, linear: LeanLinear, x: Tensor) -> Tensor:
        return self.dense(x, linear.weight, linear.bias, linear.module.packed)
