"""The decoder layers of a plain Llama-like model as one loop over their tensors (#29).

A decode step of a few sequences on the CPU spends about 1 ms of Python on the modules' generality (module calls,
parameter lookups, the family switches of each layer: some 1,000 Python calls a step) while its kernels take
5 - 10 ms, and the second thread waits through all of it. Where every layer is Llama's own (norms before each
block, no q/k norm, no window, soft-capping or sinks, a dense SiLU MLP, one rank) and the fused CPU kernels are
loaded, LeanLayers runs the same kernels in the same order over tensors gathered once (model/llama.py's
LlamaForCausalLM.lean_layers builds it): the hidden states are bit-identical to the modules'
(tests/executor/test_lean_layers.py). The linears still go through `dense`, which reads each one's packing as it is
now (the packing after ready swaps it between steps). The loop takes the kernels when it is built: patching
Linear.forward, an Attention's ops or packed.dense afterwards does not reach it; patch its own `dense` and
`paged_attention` (as benchmarks/forward_steps.py --split does), or set the model's `lean` to None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from executor_service.model.packed import dense
from executor_service.model.parallel import Linear


class StepTables(Protocol):
    """What the loop reads of a step's attention metadata (model/llama.py's AttentionMetadata)."""

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor


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


@dataclass(frozen=True, slots=True)
class LeanKernels:
    """The fused CPU kernels the loop calls besides the linears (model/llama.py's ModelOps, all present)."""

    rope_write_kv: Callable[..., Tensor]
    rms_norm: Callable[..., Tensor]
    add_rms_norm: Callable[..., Tensor]
    silu_and_mul: Callable[..., Tensor]
    paged_attention: Callable[..., Tensor]


@dataclass(frozen=True, slots=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    q_size: int
    scale: float


class LeanLayers:
    def __init__(self, layers: Sequence[LeanLayer], kernels: LeanKernels, shape: AttentionShape, eps: float) -> None:
        self.layers, self.kernels, self.shape, self.eps = list(layers), kernels, shape, eps
        self.paged_attention = kernels.paged_attention
        self.dense = dense  # (benchmarks/forward_steps.py --split times it, and paged_attention, here)

    def run(self, x: Tensor, cos: Tensor, sin: Tensor, kv_caches: Sequence[tuple[Tensor, Tensor]],
            meta: StepTables) -> tuple[Tensor, Tensor]:
        """The last layer's output and the residual stream it is yet to be added to, from the embeddings x."""
        k, shape, eps, num_tokens = self.kernels, self.shape, self.eps, x.shape[0]
        residual = x
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = k.rms_norm(x, layer.input_norm, eps) if i == 0 else k.add_rms_norm(x, residual, layer.input_norm, eps)
            q = k.rope_write_kv(self.linear(layer.qkv, h), cos, sin, k_cache, v_cache, meta.slot_mapping,
                                shape.num_heads, shape.num_kv_heads)
            out = self.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       shape.scale)
            h = k.add_rms_norm(self.linear(layer.o, out.reshape(num_tokens, shape.q_size)), residual,
                               layer.post_attention_norm, eps)
            x = self.linear(layer.down, k.silu_and_mul(self.linear(layer.gate_up, h)))
        return x, residual

    def linear(self, linear: LeanLinear, x: Tensor) -> Tensor:
        return self.dense(x, linear.weight, linear.bias, linear.module.packed)
