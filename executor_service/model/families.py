"""What distinguishes the decoder families from Llama: one parser per Hugging Face `architectures` name reads a
config.json (transformers 4.x and 5.x spellings) into `Features`, which the shared decoder (model/llama.py) and the
loader follow. A registry maps the architecture names to their parsers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any


class NormLayout(Enum):
    """Where a layer's norms sit: before each block (Llama), after each block (OLMo 2), or both (Gemma)."""

    PRE = "pre"
    POST = "post"
    SANDWICH = "sandwich"


class QKNorm(Enum):
    """RMSNorm of the queries and keys before RoPE: none, per head (Qwen3, Gemma 3), or over all heads (OLMo 2)."""

    NONE = "none"
    PER_HEAD = "per_head"
    WHOLE = "whole"


class Activation(Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"


ACTIVATIONS = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu_tanh": Activation.GELU_TANH}


@dataclass(slots=True, frozen=True)
class MoEConfig:
    """A sparse MLP: `top_k` of `num_experts` experts per token (weights renormalised over the chosen ones where
    `renormalize`), an optional shared expert with a sigmoid gate, and which layers are sparse."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    swiglu: tuple[float, float] | None = None  # GPT-OSS experts (alpha, limit): see moe.py's OaiMoE


@dataclass(slots=True, frozen=True)
class Features:
    norm_layout: NormLayout = NormLayout.PRE
    gemma_norm: bool = False  # RMSNorm weights stored as (w - 1): the norm multiplies by 1 + w, in float32
    qk_norm: QKNorm = QKNorm.NONE
    embed_scale: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    activation: Activation = Activation.SILU
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None  # None: head_dim ** -0.5
    layer_windows: tuple[int | None, ...] = ()  # per layer: the sliding window (keys visible), None: full; (): all full
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3)
    moe: MoEConfig | None = None
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    attention_sinks: bool = False  # a learned logit per head in every softmax's denominator (GPT-OSS)

    @property
    def has_windows(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def attention_extras(self) -> bool:
        """Whether some layer needs attention the fused kernels do not compute (window, soft-capping)."""
        return self.has_windows or self.attn_softcap is not None or self.attention_sinks

    @property
    def graphable(self) -> bool:
        """Whether the forward may be captured (CUDA graphs) or compiled (--compile-sizes): not with the reference
        attention's host-side plan, the experts' host-side grouping, or q/k norms (the compiled attention op's
        path does not apply them)."""
        return not self.attention_extras and self.moe is None and self.qk_norm == QKNorm.NONE


FamilyParser = Callable[[dict[str, Any], int], Features]


def positive_window(raw: dict[str, Any]) -> int | None:
    window = raw.get("sliding_window")
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None


def windows(raw: dict[str, Any], num_layers: int, sliding: Callable[[int], bool]) -> tuple[int | None, ...]:
    """Per layer: the window where the layer slides (5.x `layer_types`, else the family's 4.x rule)."""
    window = positive_window(raw)
    if window is None:
        return ()
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return tuple(window if sliding(i) else None for i in range(num_layers))


def llama(raw: dict[str, Any], num_layers: int) -> Features:
    bias = bool(raw.get("attention_bias", False))
    return Features(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def mistral(raw: dict[str, Any], num_layers: int) -> Features:
    return Features(layer_windows=windows(raw, num_layers, lambda i: True))


def qwen_windows(raw: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    if not raw.get("use_sliding_window", False):
        return ()
    first = int(raw.get("max_window_layers", num_layers))
    return windows(raw, num_layers, lambda i: i >= first)


def qwen2(raw: dict[str, Any], num_layers: int) -> Features:
    return Features(attention_bias=True, layer_windows=qwen_windows(raw, num_layers))


def qwen3(raw: dict[str, Any], num_layers: int) -> Features:
    return Features(qk_norm=QKNorm.PER_HEAD, attention_bias=bool(raw.get("attention_bias", False)),
                    layer_windows=qwen_windows(raw, num_layers))


def olmo2(raw: dict[str, Any], num_layers: int) -> Features:
    return Features(norm_layout=NormLayout.POST, qk_norm=QKNorm.WHOLE,
                    attention_bias=bool(raw.get("attention_bias", False)))


def phi3(raw: dict[str, Any], num_layers: int) -> Features:
    return Features(layer_windows=windows(raw, num_layers, lambda i: True))


def gemma_common(raw: dict[str, Any]) -> Features:
    scalar = raw.get("query_pre_attn_scalar")
    return Features(norm_layout=NormLayout.SANDWICH, gemma_norm=True, embed_scale=True,
                    activation=ACTIVATIONS.get(str(raw.get("hidden_activation") or "gelu_pytorch_tanh"),
                                               Activation.GELU_TANH),
                    query_scale=float(scalar) ** -0.5 if scalar else None,
                    attention_bias=bool(raw.get("attention_bias", False)),
                    attn_softcap=optional_float(raw.get("attn_logit_softcapping")),
                    final_softcap=optional_float(raw.get("final_logit_softcapping")))


def gemma2(raw: dict[str, Any], num_layers: int) -> Features:
    return replace(gemma_common(raw), layer_windows=windows(raw, num_layers, lambda i: i % 2 == 0))


def gemma3(raw: dict[str, Any], num_layers: int) -> Features:
    pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
    params = raw.get("rope_parameters")
    local = params.get("sliding_attention") if isinstance(params, dict) else None
    local_theta = local.get("rope_theta") if isinstance(local, dict) else None
    local_theta = local_theta or raw.get("rope_local_base_freq") or 10000.0
    return replace(gemma_common(raw), qk_norm=QKNorm.PER_HEAD, local_rope_theta=float(local_theta),
                   layer_windows=windows(raw, num_layers, lambda i: (i + 1) % pattern != 0))


def mixtral(raw: dict[str, Any], num_layers: int) -> Features:
    moe = MoEConfig(num_experts(raw), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]),
                    True, 0, (True,) * num_layers)
    return Features(moe=moe, layer_windows=windows(raw, num_layers, lambda i: True))


def qwen_moe(raw: dict[str, Any], num_layers: int, base: Features) -> Features:
    step = int(raw.get("decoder_sparse_step", 1) or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    moe = MoEConfig(num_experts(raw), int(raw["num_experts_per_tok"]), int(raw["moe_intermediate_size"]),
                    bool(raw.get("norm_topk_prob", False)), int(raw.get("shared_expert_intermediate_size") or 0),
                    sparse)
    return replace(base, moe=moe)


def qwen2_moe(raw: dict[str, Any], num_layers: int) -> Features:
    return qwen_moe(raw, num_layers, Features(attention_bias=bool(raw.get("qkv_bias", True)),
                                              layer_windows=qwen_windows(raw, num_layers)))


def qwen3_moe(raw: dict[str, Any], num_layers: int) -> Features:
    return qwen_moe(raw, num_layers, qwen3(raw, num_layers))


def num_experts(raw: dict[str, Any]) -> int:
    """`num_experts` (Qwen checkpoints) or `num_local_experts` (Mixtral; Qwen3-MoE as transformers 5.x writes it)."""
    return int(raw["num_experts"] if raw.get("num_experts") is not None else raw["num_local_experts"])


def gpt_oss(raw: dict[str, Any], num_layers: int) -> Features:
    moe = MoEConfig(num_experts(raw), int(raw["num_experts_per_tok"]), int(raw["intermediate_size"]), True, 0,
                    (True,) * num_layers, (float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0))))
    bias = bool(raw.get("attention_bias", True))
    return Features(moe=moe, attention_bias=bias, o_proj_bias=bias, attention_sinks=True,
                    layer_windows=windows(raw, num_layers, lambda i: i % 2 == 0))


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


FAMILIES: dict[str, FamilyParser] = {
    "LlamaForCausalLM": llama,
    "MistralForCausalLM": mistral,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "Olmo2ForCausalLM": olmo2,
    "Phi3ForCausalLM": phi3,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "MixtralForCausalLM": mixtral,
    "Qwen2MoeForCausalLM": qwen2_moe,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "GptOssForCausalLM": gpt_oss,
}
"""Hugging Face architecture name -> its parser; the order is the README's list."""

SILU_ONLY = frozenset(name for name in FAMILIES if not name.startswith("Gemma"))
