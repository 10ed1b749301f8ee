"""Llama-family decoder (Llama, Mistral, Qwen2) over a flat packed batch and a paged KV cache."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.functional import rms_norm, silu

from executor_service.attention import PagedAttentionFn, WriteKVFn
from executor_service.model.calibration import calibrate, choose_packing
from executor_service.model.config import ModelConfig, RopeScaling
from executor_service.model.packed import Packing, can_pack
from executor_service.model.parallel import (
    SINGLE,
    Linear,
    ParallelContext,
    ParallelLMHead,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
)
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
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, ops: ModelOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps
        self.fused_norm = ops.rms_norm if ops is not None else None
        self.fused_add_norm = ops.add_rms_norm if ops is not None else None

    def forward(self, x: Tensor) -> Tensor:
        if self.fused_norm is not None and not torch.compiler.is_compiling():
            return self.fused_norm(x, self.weight, self.eps)
        input_dtype = x.dtype
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
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = layout.num_heads * cfg.head_dim
        self.kv_size = layout.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.ops = ops
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, cfg.attention_bias, dtype)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_proj_bias, dtype, parallel)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = kv_cache
        if self.ops.rope_write_kv is not None:
            q = self.ops.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, self.num_heads,
                                       self.num_kv_heads)
        else:
            q = self.rope_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size))

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

    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        inter = self.intermediate_size = layout.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, cfg.mlp_bias, dtype, parallel)
        self.fused_silu_and_mul = ops.silu_and_mul

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused_silu_and_mul is not None and not torch.compiler.is_compiling():
            return self.down_proj(self.fused_silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(silu(gate).mul_(up))  # contiguous rows: the skinny kernel takes them


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layout, ops, dtype, parallel)
        self.mlp = MLP(cfg, layout, ops, dtype, parallel)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)

    def forward(self, x: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """This layer's output and the residual stream it is yet to be added to; `x` is the last layer's output
        (the embeddings, with no residual yet, for the first layer)."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h, residual = self.post_attention_layernorm.add_forward(self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: ShardLayout, ops: ModelOps, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(layout, cfg.hidden_size, dtype, parallel)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, ops, dtype, parallel) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)


class LlamaForCausalLM(nn.Module):
    """Parameters are created uninitialised on `device`; fill them with the loader.

    Parameter names follow Hugging Face's, except the fused `qkv_proj` (q, k, v stacked on the
    output dimension) and `gate_up_proj` (gate, up). Under tensor parallelism (`parallel`) each
    parameter is this rank's shard, as `layout` describes."""

    inv_freq: Tensor

    def __init__(self, cfg: ModelConfig, ops: ModelOps, *, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.config = cfg
        self.parallel = parallel
        self.layout = ShardLayout.of(cfg, parallel.rank, parallel.world_size)
        with torch.device("meta"):
            self.model = LlamaModel(cfg, self.layout, ops, dtype, parallel)
            self.lm_head = ParallelLMHead(self.layout, cfg.hidden_size, dtype, parallel)
        self.to_empty(device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", compute_inv_freq(cfg).to(device), persistent=False)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, kv_caches: KVCaches,
                output_rows: Tensor | None = None) -> Tensor:
        """Hidden states after the final norm, for `output_rows` of the packed batch (all rows if None)."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"expected {len(self.model.layers)} KV cache layers, got {len(kv_caches)}")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos_sin(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        if output_rows is not None:
            x = x.index_select(0, output_rows)
            residual = None if residual is None else residual.index_select(0, output_rows)
        return self.model.norm.add_forward(x, residual)[0]

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
        return [m for m in self.modules() if isinstance(m, Linear) and can_pack(m.weight)]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits of `hidden`'s rows (gathered from every rank under tensor parallelism)."""
        return self.lm_head(hidden).float()

    def rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [num_tokens, 1, head_dim / 2] (the two halves of Hugging Face's tables are equal)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


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


def compute_inv_freq(cfg: ModelConfig) -> Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return scale_llama3(inv_freq, scaling)
    raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")


def scale_llama3(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    factor = scaling.factor
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
