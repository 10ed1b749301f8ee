"""Model configuration parsed from a Hugging Face config.json (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executor_service.model.families import FAMILIES, SILU_ONLY, Features

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
DEFAULT_ROPE_THETA = 10000.0


class ModelLoadError(RuntimeError):
    """The model directory cannot be served: missing file, unsupported architecture or missing weight."""


@dataclass(slots=True, frozen=True)
class RopeScaling:
    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to the original length, and beyond
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope, yarn: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn: the correction range's rotations
    beta_slow: float = 1.0
    truncate: bool = True  # yarn: round the correction range to whole dimensions


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    dtype: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None
    features: Features = field(default_factory=Features)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return self.features.layer_windows or (None,) * self.num_layers

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"model directory {model_dir}: missing file config.json")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read config: {exc}") from exc
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        architecture = read_architecture(raw, source)
        hidden_size = require_int(raw, "hidden_size", source)
        num_heads = require_int(raw, "num_attention_heads", source)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        check_activation(raw, architecture, source)
        check_heads(num_heads, num_kv_heads, source)
        rope_theta, rope_scaling = read_rope(raw, source)
        num_layers = require_int(raw, "num_hidden_layers", source)
        features = read_features(raw, architecture, num_layers, source)
        return cls(
            architecture=architecture,
            vocab_size=require_int(raw, "vocab_size", source),
            hidden_size=hidden_size,
            intermediate_size=require_int(raw, "intermediate_size", source),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=features.attention_bias,
            o_proj_bias=features.o_proj_bias,
            mlp_bias=features.mlp_bias,
            dtype=read_dtype(raw),
            eos_token_ids=read_token_ids(raw.get("eos_token_id")),
            bos_token_id=read_optional_int(raw.get("bos_token_id")),
            sliding_window=max((w for w in features.layer_windows if w is not None), default=None),
            features=features,
        )


def read_architecture(raw: dict[str, Any], source: str) -> str:
    architectures = raw.get("architectures") or []
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return str(name)
    found = ", ".join(map(str, architectures)) or "none"
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise ModelLoadError(f"{source}: unsupported architecture ({found}); supported: {supported}")


def require_int(raw: dict[str, Any], key: str, source: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{source}: {key} must be a positive integer, got {value!r}")
    return value


def check_activation(raw: dict[str, Any], architecture: str, source: str) -> None:
    act = raw.get("hidden_act", "silu")
    if architecture in SILU_ONLY and act != "silu":
        raise ModelLoadError(f"{source}: unsupported hidden_act {act!r}; only 'silu' is supported")


def read_features(raw: dict[str, Any], architecture: str, num_layers: int, source: str) -> Features:
    try:
        return FAMILIES[architecture](raw, num_layers)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: cannot read the {architecture} settings: {exc!r}") from exc


def check_heads(num_heads: int, num_kv_heads: int, source: str) -> None:
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads ({num_heads}) must be a multiple of"
            f" num_key_value_heads ({num_kv_heads})"
        )


def read_rope(raw: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = raw.get("rope_parameters") or {}
    if params and not isinstance(params, dict):
        raise ModelLoadError(f"{source}: rope_parameters must be an object")
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers' here
        params = params["full_attention"]
    legacy = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    scaling = {**legacy, **params}
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    rope_type = "longrope" if rope_type == "su" else rope_type
    if float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor other than 1.0 is not supported")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    original = scaling.get("original_max_position_embeddings",
                           raw.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192)))
    if rope_type == "longrope":
        return theta, read_longrope(raw, scaling, int(original), source)
    if "factor" not in scaling:
        raise ModelLoadError(f"{source}: rope_type {rope_type!r} needs a 'factor'")
    if rope_type == "yarn":
        return theta, read_yarn(scaling, int(original))
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def read_longrope(raw: dict[str, Any], scaling: dict[str, Any], original: int, source: str) -> RopeScaling:
    """Phi-3's LongRoPE (also spelled "su"): short factors up to the original length, long ones beyond; cos and sin
    scaled by sqrt(1 + ln(factor) / ln(original)) unless the config names the attention factor."""
    try:
        short, long = tuple(map(float, scaling["short_factor"])), tuple(map(float, scaling["long_factor"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{source}: longrope needs short_factor and long_factor lists: {exc!r}") from exc
    factor = float(scaling.get("factor") or int(raw.get("max_position_embeddings", original)) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling("longrope", factor, original_max_position_embeddings=original, short_factor=short,
                       long_factor=long, attention_factor=float(attention))


def read_yarn(scaling: dict[str, Any], original: int) -> RopeScaling:
    """YaRN (GPT-OSS): interpolation blended with extrapolation over a correction range of dimensions; cos and sin
    scaled by 0.1 ln(factor) + 1 (or the ratio of the two mscales) unless the config names the attention factor."""
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return RopeScaling("yarn", factor, original_max_position_embeddings=original, attention_factor=float(attention),
                       beta_fast=float(scaling.get("beta_fast") or 32), beta_slow=float(scaling.get("beta_slow") or 1),
                       truncate=bool(scaling.get("truncate", True)))


def read_dtype(raw: dict[str, Any]) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    return str(value).removeprefix("torch.")


def read_token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def read_optional_int(value: Any) -> int | None:
    return None if value is None else int(value)

