"""The decoder shared by every supported family (model/families.py: Llama, Mistral, Qwen2/3, OLMo 2, Phi-3, Gemma 2/3,
Mixtral, Qwen2/3-MoE) over a flat packed batch and a paged KV cache: Llama's layer, with each family's pieces
(q/k norms, post and sandwich norms, GeGLU, scaled embeddings, soft-capping, sliding windows, local RoPE bases,
mixture-of-experts MLPs) switched on by its `Features`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import gelu, rms_norm, silu

from executor_service.attention import PagedAttentionFn, WriteKVFn
from executor_service.attention.reference import Extras, Scratch
from executor_service.attention.reference import paged_attention as reference_attention
from executor_service.attention.reference import write_kv as reference_write_kv
from executor_service.model.calibration import calibrate, choose_packing
from executor_service.model.config import ModelConfig
from executor_service.model.families import Activation, NormLayout, QKNorm
from executor_service.model.lean_layers import AttentionShape, LeanKernels, LeanLayer, LeanLayers, LeanLinear
from executor_service.model.moe import OaiMoE, SparseMoE
from executor_service.model.packed import Packing, can_pack
from executor_service.model.parallel import (
    SINGLE,
    Linear,
    ParallelContext,
    ParallelLMHead,
    RowParallelLinear,
    ShardedRMSNorm,
    ShardLayout,
    VocabParallelEmbedding,
)
from executor_service.model.rope import CosSinCache, RopeTables
from executor_service.startup import MeasureCache

KVCaches = Sequence[tuple[Tensor, Tensor]]


@dataclass(slots=True)
class AttentionMetadata:
    """slot_mapping int64 [num_tokens]; block_tables int32 [num_seqs, max_blocks];
    seq_lens int32 [num_seqs] (context incl. this step); query_start_loc int32 [num_seqs + 1]."""

    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    layer_metas: list[AttentionMetadata] | None = None
    """KV cache groups: per layer, the metadata of its group's tables (runner/kv_groups.py); None: this one."""
    read_fresh: bool = False
    """Ring window tables (runner/kv_groups.py): the layers read the step's own keys as computed and write them
    after attending, at slot_mapping (-1: not written)."""


RopeWriteKVFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int], Tensor]
RMSNormFn = Callable[[Tensor, Tensor, float], Tensor]
AddRMSNormFn = Callable[[Tensor, Tensor, Tensor, float], Tensor]
SiluAndMulFn = Callable[[Tensor], Tensor]


@dataclass(slots=True)
class ModelOps:
    """The kernels the model calls besides its linears: writing and attending over the paged KV cache, and
    optional fused ones: rope_write_kv (apply_rope + write_kv, returns the queries), rms_norm, add_rms_norm
    (residual += x, then the norm of the sum) and silu_and_mul (of the fused gate/up output) in one pass each."""

    write_kv: WriteKVFn
    paged_attention: PagedAttentionFn
    rope_write_kv: RopeWriteKVFn | None = None
    rms_norm: RMSNormFn | None = None
    add_rms_norm: AddRMSNormFn | None = None
    silu_and_mul: SiluAndMulFn | None = None


class RMSNorm(nn.Module):
    """Llama's RMSNorm; with `gemma` Gemma's, whose weight w stands for 1 + w, applied in float32."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModelOps | None = None,
                 gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.gemma = gemma
        self.fused_norm = ops.rms_norm if ops is not None and not gemma else None
        self.fused_add_norm = ops.add_rms_norm if ops is not None and not gemma else None

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_norm is not None and not torch.compiler.is_compiling():
            return self.fused_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
        if self.gemma:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(input_dtype)
        if input_dtype == torch.float32:  # one fused kernel, bit-identical to the steps below
            return rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(input_dtype)

    def add_forward(self, x: Tensor, residual: Tensor | None) -> tuple[Tensor, Tensor]:
        """The norm of residual + x, and that sum, which is the residual updated in place (x itself where the
        residual is None: the stream starts at x)."""
        if residual is None:
            return self(x), x
        if self.fused_add_norm is not None and not torch.compiler.is_compiling():
            return self.fused_add_norm(x, residual, self.weight, self.eps), residual
        return self(residual.add_(x)), residual


class Attention(nn.Module):
    """This rank's query heads and the KV heads they use: QKV column-parallel, o_proj row-parallel."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext, window: int | None = None, scratch: Scratch | None = None) -> None:
        super().__init__()
        features = cfg.features
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = layout.num_heads * cfg.head_dim
        self.kv_size = layout.num_kv_heads * cfg.head_dim
        self.scale = features.query_scale or cfg.head_dim**-0.5
        self.ops = ops
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, parallel)
        self.qk_norm = features.qk_norm
        self.q_norm: nn.Module
        self.k_norm: nn.Module
        if features.qk_norm == QKNorm.WHOLE and parallel.world_size > 1:
            replicas = max(1, parallel.world_size // cfg.num_kv_heads)
            self.q_norm = ShardedRMSNorm(self.q_size, cfg.num_heads * cfg.head_dim, cfg.rms_norm_eps, dtype, parallel)
            self.k_norm = ShardedRMSNorm(self.kv_size, cfg.num_kv_heads * cfg.head_dim, cfg.rms_norm_eps, dtype,
                                         parallel, replicas)
        elif features.qk_norm != QKNorm.NONE:
            whole = features.qk_norm == QKNorm.WHOLE
            norm_ops = ops if whole else None  # the fused kernel takes whole rows only
            q_dim, k_dim = (self.q_size, self.kv_size) if whole else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, dtype, norm_ops, features.gemma_norm)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, dtype, norm_ops, features.gemma_norm)
        self.window, self.softcap = window, features.attn_softcap
        self.has_extras = bool(window or features.attn_softcap or features.attention_sinks)
        self.sinks = nn.Parameter(torch.empty(layout.num_heads, dtype=dtype)) if features.attention_sinks else None
        self.scratch = scratch

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        qkv = self.norm_qk(self.qkv_proj(x))
        k_cache, v_cache = kv_cache
        if meta.read_fresh:
            return self.o_proj(self.attend_ring(qkv, cos, sin, k_cache, v_cache, meta).reshape(num_tokens, self.q_size))
        if self.ops.rope_write_kv is not None:
            q = self.ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                       self.num_kv_heads)
        else:
            q = self.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping)
        if self.has_extras:  # the torch reference computes windows, soft-capping and sinks on every device
            out = reference_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                      self.scale, self.scratch, Extras(self.window, self.softcap, self.sinks))
        else:
            out = self.ops.paged_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
            )
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def attend_ring(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                    meta: AttentionMetadata) -> Tensor:
        """A window layer over ring tables: the queries attend the ring's keys before the step and the step's own
        keys as computed; only then are the step's keys written (over ring blocks its queries may have read)."""
        q, k, v = self.split_rope(qkv, cos, sin)
        extras = Extras(self.window, self.softcap, self.sinks, (k, v))
        out = reference_attention(q.contiguous(), k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                  meta.query_start_loc, self.scale, self.scratch, extras)
        reference_write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return out

    def norm_qk(self, qkv: Tensor) -> Tensor:
        """qkv with its queries and keys RMS-normalised in place (per head or over all heads), where the family
        does so."""
        if self.qk_norm == QKNorm.NONE:
            return qkv
        n, q_size, kv_size = qkv.shape[0], self.q_size, self.kv_size
        q, k = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size]
        if self.qk_norm == QKNorm.PER_HEAD:
            q_normed = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).reshape(n, q_size)
            k_normed = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).reshape(n, kv_size)
        else:
            q_normed, k_normed = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q.copy_(q_normed)
        k.copy_(k_normed)
        return qkv

    def rope_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                      slot_mapping: Tensor) -> Tensor:
        q, k, v = self.split_rope(qkv, cos, sin)
        self.ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def split_rope(self, qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [tokens, heads, head_dim] and k with the rotary embedding applied, v [tokens, kv_heads, head_dim]."""
        num_tokens = qkv.shape[0]
        qk_size = self.q_size + self.kv_size
        qk = apply_rope(qkv[:, :qk_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        v = qkv[:, qk_size:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v


class MLP(nn.Module):
    """This rank's slice of the intermediate dimension: gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, inter: int, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.intermediate_size = inter
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, parallel)
        self.gelu = cfg.features.activation == Activation.GELU_TANH
        self.fused_silu_and_mul = None if self.gelu else ops.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_silu_and_mul is not None and not torch.compiler.is_compiling():
            return self.down_proj(self.fused_silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        if self.gelu:
            return self.down_proj(gelu(gate, approximate="tanh").mul_(up))
        return self.down_proj(silu(gate).mul_(up))  # contiguous rows: the skinny kernel takes them


class DecoderLayer(nn.Module):
    """Norms where the family puts them (NormLayout): `input_layernorm` before attention and
    `post_attention_layernorm` before the MLP (PRE); `post_attention_layernorm` and `post_feedforward_layernorm`
    after each block (POST); both, with `pre_feedforward_layernorm` before the MLP (SANDWICH)."""

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext, index: int, scratches: dict[int | None, Scratch]) -> None:
        super().__init__()
        features = cfg.features
        window = cfg.layer_windows[index]
        self.layout_kind = features.norm_layout
        self.uses_local_rope = window is not None and features.local_rope_theta is not None
        self.self_attn = Attention(cfg, layout, ops, dtype, parallel, window, scratches[window])
        self.mlp = make_mlp(cfg, layout, ops, dtype, parallel, index)
        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, features.gemma_norm)
        if self.layout_kind != NormLayout.POST:
            self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        if self.layout_kind == NormLayout.SANDWICH:
            self.pre_feedforward_layernorm = norm()
        if self.layout_kind != NormLayout.PRE:
            self.post_feedforward_layernorm = norm()

    def is_plain(self) -> bool:
        """Llama's own layer, which LeanLayers runs (LlamaForCausalLM.lean_layers checks the fused kernels are there):
        norms before each block (fused, not Gemma's), no q/k norm, window, soft-capping or sinks, global RoPE, a dense
        SiLU MLP."""
        attention, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm) if self.layout_kind == NormLayout.PRE else ()
        return (bool(norms) and not self.uses_local_rope and attention.qk_norm == QKNorm.NONE
                and not attention.has_extras and isinstance(mlp, MLP) and mlp.fused_silu_and_mul is not None
                and all(n.fused_norm is not None and n.fused_add_norm is not None for n in norms))

    def lean(self) -> LeanLayer:
        """This (plain) layer's tensors for LeanLayers."""
        attention, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, MLP):
            raise TypeError("only a plain layer (is_plain) has a lean form")
        return LeanLayer(self.input_layernorm.weight, self.post_attention_layernorm.weight,
                         LeanLinear.of(attention.qkv_proj), LeanLinear.of(attention.o_proj),
                         LeanLinear.of(mlp.gate_up_proj), LeanLinear.of(mlp.down_proj))

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """This layer's output and the residual stream it is yet to be added to; `x` is the last layer's output
        (the embeddings, with no residual yet, for the first layer)."""
        if self.layout_kind == NormLayout.PRE:
            h, residual = self.input_layernorm.add_forward(x, residual)
            h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, kv_cache, meta),
                                                                    residual)
            return self.mlp(h), residual
        if self.layout_kind == NormLayout.POST:
            stream = x if residual is None else residual.add_(x)
            stream = stream.add_(self.post_attention_layernorm(self.self_attn(stream, cos, sin, kv_cache, meta)))
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        h, residual = self.input_layernorm.add_forward(x, residual)
        attended = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, meta))
        h, residual = self.pre_feedforward_layernorm.add_forward(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


def make_mlp(cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype, parallel: ParallelContext,
             index: int) -> nn.Module:
    """Layer `index`'s MLP: dense, or sparse (mixture of experts, with its shared expert where the family has one)."""
    moe = cfg.features.moe
    if moe is None or not moe.sparse_layers[index]:
        return MLP(cfg, layout.intermediate_size, ops, dtype, parallel)
    if moe.swiglu is not None:
        return OaiMoE(cfg.hidden_size, moe, moe.intermediate_size // layout.world_size, dtype, parallel)
    shared_inter = moe.shared_intermediate_size // layout.world_size
    shared = MLP(cfg, shared_inter, ops, dtype, parallel) if shared_inter else None
    return SparseMoE(cfg.hidden_size, moe, moe.intermediate_size // layout.world_size, shared, dtype, parallel)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, cfg.hidden_size, dtype, parallel)
        scratches: dict[int | None, Scratch] = {w: Scratch() for w in {None, *cfg.layer_windows}}  # a plan per window
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, ops, dtype, parallel, i, scratches)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, cfg.features.gemma_norm)


def materialize(module: nn.Module, device: torch.device) -> None:
    """Module.to_empty(device=device) for a module built on the meta device: every parameter and buffer an
    uninitialised tensor on `device` (shared ones stay shared). torch.empty directly: to_empty's empty_like from
    meta goes through torch's Python references, whose first call imports sympy (0.6 - 1.7 s of a start, #33)."""
    made: dict[int, Tensor] = {}

    def fresh(t: Tensor) -> Tensor:
        if id(t) not in made:
            empty = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for sub in module.modules():
        for group in (sub._parameters, sub._buffers):
            for name, tensor in group.items():
                if tensor is not None:
                    group[name] = fresh(tensor)  # type: ignore[assignment]


class LlamaForCausalLM(nn.Module):
    """Parameters are created uninitialised on `device`; fill them with the loader.

    Parameter names follow Hugging Face's, except the fused `qkv_proj` (q, k, v stacked on the
    output dimension) and `gate_up_proj` (gate, up), and the experts of a sparse MLP stacked in
    `mlp.experts.w13` and `mlp.experts.w2`. Under tensor parallelism (`parallel`) each
    parameter is this rank's shard, as `layout` describes."""

    inv_freq: Tensor
    lean: LeanLayers | None

    def __init__(self, cfg: ModelConfig, ops: ModelOps, *, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.layout = ShardLayout.of(cfg, parallel.rank, parallel.world_size)
        with torch.device("meta"):
            self.model = LlamaModel(cfg, self.layout, ops, dtype, parallel)
            self.lm_head = ParallelLMHead(self.layout, cfg.hidden_size, dtype, parallel)
        materialize(self, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RopeTables.of(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        local_theta = cfg.features.local_rope_theta
        self.local_rope = None if local_theta is None else RopeTables.of(cfg.head_dim, local_theta, None, device)
        self.cos_sin = CosSinCache(self.rope)
        self.local_cos_sin = None if self.local_rope is None else CosSinCache(self.local_rope)
        self.register_buffer("inv_freq", self.rope.inv_freq, persistent=False)
        self.embed_scale = cfg.hidden_size**0.5 if cfg.features.embed_scale else None
        self.final_softcap = cfg.features.final_softcap
        self.lean = self.lean_layers(ops)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                output_rows: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, for `output_rows` of the packed batch (all rows if None)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV cache layers, got {len(kv_caches)}")
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        cos, sin = self.cos_sin.cos_sin(positions, x.dtype)
        local = self.local_cos_sin.cos_sin(positions, x.dtype) if self.local_cos_sin is not None else (cos, sin)
        residual: Tensor | None = None
        # (torch.compile traces with meta None: runner/compiled.py hands each layer its step's metadata itself)
        if self.lean is not None and meta is not None and not meta.layer_metas and not meta.read_fresh \
                and not torch.compiler.is_compiling():
            x, residual = self.lean.run(x, cos, sin, kv_caches, meta)
        else:
            metas = meta.layer_metas if meta is not None and meta.layer_metas else [meta] * len(kv_caches)
            for layer, kv_cache, layer_meta in zip(self.model.layers, kv_caches, metas, strict=True):
                layer_cos, layer_sin = local if layer.uses_local_rope else (cos, sin)
                x, residual = layer(x, residual, layer_cos, layer_sin, kv_cache, layer_meta)
        if output_rows is not None:
            x = x.index_select(0, output_rows)
            residual = None if residual is None else residual.index_select(0, output_rows)
        return self.model.norm.add_forward(x, residual)[0]

    def lean_layers(self, ops: ModelOps) -> LeanLayers | None:
        """The layers as one loop over their tensors (model/lean_layers.py), where all of them are plain and run on one
        rank with the fused kernels; None otherwise (the modules run them)."""
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        plain = self.parallel.world_size == 1 and self.embed_scale is None and all(layer.is_plain() for layer in layers)
        if not plain or ops.rope_write_kv is None or ops.rms_norm is None or ops.add_rms_norm is None \
                or ops.silu_and_mul is None:
            return None
        kernels = LeanKernels(ops.rope_write_kv, ops.rms_norm, ops.add_rms_norm, ops.silu_and_mul, ops.paged_attention)
        attention = layers[0].self_attn
        shape = AttentionShape(attention.num_heads, attention.num_kv_heads, attention.q_size, attention.scale)
        return LeanLayers([layer.lean() for layer in layers], kernels, shape, self.config.rms_norm_eps)

    def pack_weights(self, requested: str = "auto", skinny_rows: int = -1, cache: MeasureCache | None = None,
                     measure_later: bool = False) -> Packing:
        """Pack every linear weight once for the CPU's GEMM (float32 CPU weights only; others are left as they are):
        `requested` ("mkl", "onednn"), or with "auto" the faster of the two on this model's shapes; and let batches
        of up to `skinny_rows` rows (-1: as many as beat the GEMM, measured here) take the skinny kernel. What is
        measured is kept in `cache` under a key of everything it depends on (packing_key), and taken from it on
        the next start where that key matches; with `measure_later` a start with nothing cached packs by a rule
        (model/calibration.py) and leaves the measurement to calibrate_packing()."""
        linears = self.packable_linears()
        if not linears:
            return Packing(None, 0)
        return choose_packing(linears, requested, skinny_rows, cache, measure_later)

    def calibrate_packing(self, requested: str = "auto", skinny_rows: int = -1,
                          cache: MeasureCache | None = None) -> Packing:
        """Measure the packing choice now, swap it in (while forward passes may run) and keep it in `cache`."""
        linears = self.packable_linears()
        return calibrate(linears, requested, skinny_rows, cache) if linears else Packing(None, 0)

    def packable_linears(self) -> list[Linear]:
        """The linears pack_weights packs: float32 CPU ones, but for the experts pack_experts packs instead."""
        fused = {id(m) for moe in self.fusable_moes() for m in moe.experts.modules()}
        return [m for m in self.modules() if isinstance(m, Linear) and can_pack(m.weight) and id(m) not in fused]

    def fusable_moes(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE) and m.can_fuse()]

    def pack_experts(self) -> None:
        """Pack the sparse MoE blocks' experts for the fused CPU kernel (model/moe.py), where it can run."""
        for moe in self.fusable_moes():
            moe.pack_experts()

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits of `hidden`'s rows (gathered from every rank under tensor parallelism),
        soft-capped where the family does (Gemma 2)."""
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [num_tokens, 1, head_dim / 2] of the global layers' RoPE."""
        return self.rope.cos_sin(positions, dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x [num_tokens, heads, head_dim] (any row stride) into a new tensor: the same products
    and sums as Hugging Face's `x * cos + rotate_half(x) * sin`, without the concatenated temporaries."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if torch.compiler.is_compiling():  # the same expressions without `out=` views, which dynamo cannot trace
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half:]).add_(x1 * sin)
    return out
