"""The model forward compiled with torch.compile (inductor), one graph per bucketed token count, on the CPU.

A step of n tokens (decode or prefill, n <= the largest size) runs the graph of the smallest size >= n, compiled
on first use with static shapes: input ids and positions are padded to the size, so a step's contexts and the
number of its sequences never cause a recompile. The step's attention metadata and the KV cache are not graph
inputs: each layer's attention is one opaque custom op (`pagedserve_compiled::attention`: write K/V, attend)
that reads them from the step's context, as vLLM's forward context does, so the compiled graph neither guards
on nor copies the cache. Padding tokens write no K/V and belong to no sequence; their rows of the output are
left unset and cut off. Opt-in with --compile-sizes (benchmarks/compile_forward.py: 10 - 20% faster at
small decode batches, within noise at 64, slower for prefill).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from executor_service.deferred_imports import run_deferred
from executor_service.model import AttentionMetadata, LlamaForCausalLM, ModelOps
from executor_service.model.llama import Attention, KVCaches

log = logging.getLogger(__name__)


@dataclass(slots=True, weakref_slot=True)
class StepContext:
    """What the attention op of a compiled step reads besides q, k and v."""

    ops: ModelOps
    kv_caches: KVCaches
    meta: AttentionMetadata | None = None
    num_tokens: int = 0


# one per CompiledForward (which holds it), named by the op's `handle` argument
_CONTEXTS: weakref.WeakValueDictionary[int, StepContext] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


@torch.library.custom_op("pagedserve_compiled::attention", mutates_args=())
def attention_op(query: Tensor, key: Tensor, value: Tensor, layer: int, scale: float, handle: int) -> Tensor:
    """Write the step's K/V into the layer's cache and attend, with the executor's attention ops."""
    ctx = _CONTEXTS[handle]
    meta, n = ctx.meta, ctx.num_tokens
    if meta is None:
        raise RuntimeError("pagedserve_compiled::attention runs only inside a compiled step")
    k_cache, v_cache = ctx.kv_caches[layer]
    ctx.ops.write_kv(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping)
    return ctx.ops.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale)


@attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, layer: int, scale: float, handle: int) -> Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


PACKED_LINEAR = "pagedserve_model::linear"  # model/packed.py's op: (x, packed, weight, bias) -> x @ weight^T + bias
SKINNY_LINEAR = "pagedserve_model::skinny_linear"  # and its skinny kernel: (x, weight, bias) -> the same


def register_packed_linear_fake() -> None:
    """The packed CPU linear and the skinny one (model/packed.py), when loaded, are opaque to the compiler too."""
    if needs_fake(PACKED_LINEAR):
        @torch.library.register_fake(PACKED_LINEAR)
        def packed_fake(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            return x.new_empty((x.shape[0], weight.shape[0]))

    if needs_fake(SKINNY_LINEAR):
        @torch.library.register_fake(SKINNY_LINEAR)
        def skinny_fake(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
            return x.new_empty((x.shape[0], weight.shape[0]))


def needs_fake(op: str) -> bool:
    namespace, name = op.split("::")
    return hasattr(getattr(torch.ops, namespace), name) and not torch._C._dispatch_has_kernel_for_dispatch_key(
        op, "Meta")


def route_attention(attn: Attention, layer: int, handle: int) -> None:
    """While compiling, this layer's write and attend are the opaque op; eager calls are unchanged."""
    eager_forward = attn.forward

    def forward(x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        if not torch.compiler.is_compiling():
            return eager_forward(x, cos, sin, kv_cache, meta)
        q, k, v = attn.split_rope(attn.qkv_proj(x), cos, sin)
        out = torch.ops.pagedserve_compiled.attention(q, k, v, layer, attn.scale, handle)
        return attn.o_proj(out.reshape(x.shape[0], attn.q_size))

    attn.forward = forward  # type: ignore[method-assign]


class CompiledForward:
    """The model's forward compiled per size (lazily); `run` says None for steps no size holds."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, sizes: tuple[int, ...],
                 options: dict[str, Any] | None = None) -> None:
        if not sizes or sizes[0] < 1:
            raise ValueError(f"compile sizes must be positive token counts, got {sizes}")
        self.sizes = tuple(sorted(sizes))
        self.compile_seconds: dict[int, float] = {}
        attentions = [m for m in model.modules() if isinstance(m, Attention)]  # in layer order
        self.context = StepContext(attentions[0].ops, kv_caches)
        handle = next(_HANDLES)
        _CONTEXTS[handle] = self.context
        for i, attention in enumerate(attentions):
            route_attention(attention, i, handle)
        run_deferred()  # tracing uses fake tensors: torch's Python meta kernels must be registered
        register_packed_linear_fake()
        unused = [(torch.empty(0), torch.empty(0))] * len(attentions)

        def forward(input_ids: Tensor, positions: Tensor) -> Tensor:
            return model(input_ids, positions, None, unused)

        # one graph per size and model; a process may hold several models (tests)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(self.sizes))
        self.compiled = torch.compile(forward, backend="inductor", dynamic=False, fullgraph=True, options=options)

    def bucket(self, num_tokens: int) -> int | None:
        return next((s for s in self.sizes if s >= num_tokens), None)

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """Final hidden states [n, hidden] of every token of a step of n tokens, or None when no size holds it."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None:
            return None
        ids, pos = pad(input_ids, size), pad(positions, size)
        self.context.meta, self.context.num_tokens = meta, n
        try:
            if size in self.compile_seconds:
                return self.compiled(ids, pos)[:n]
            start = time.perf_counter()
            hidden = self.compiled(ids, pos)[:n]
            self.compile_seconds[size] = time.perf_counter() - start
            log.info("compiled the forward for %d tokens in %.1f s", size, self.compile_seconds[size])
            return hidden
        finally:
            self.context.meta = None


def pad(t: Tensor, size: int) -> Tensor:
    if t.shape[0] == size:
        return t
    out = t.new_zeros(size)
    out[: t.shape[0]] = t
    return out
