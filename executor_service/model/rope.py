"""Rotary position embedding tables: the inverse frequencies of each RoPE variant (default, linear, llama3,
Phi-3's LongRoPE) and the cos/sin of a step's positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from executor_service.model.config import RopeScaling


@dataclass(slots=True, frozen=True)
class RopeTables:
    """The inverse frequencies of one RoPE variant; `long_inv_freq` (LongRoPE) takes over from position
    `long_from` on, and cos and sin are multiplied by `attention_factor`."""

    inv_freq: Tensor
    long_inv_freq: Tensor | None = None
    long_from: int = 0
    attention_factor: float = 1.0

    @classmethod
    def of(cls, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> RopeTables:
        base = default_inv_freq(head_dim, theta)
        if scaling is None:
            return cls(base.to(device))
        if scaling.rope_type == "linear":
            return cls((base / scaling.factor).to(device))
        if scaling.rope_type == "llama3":
            return cls(scale_llama3(base, scaling).to(device))
        if scaling.rope_type == "longrope":
            short = base / torch.tensor(scaling.short_factor, dtype=torch.float32)
            long = base / torch.tensor(scaling.long_factor, dtype=torch.float32)
            return cls(short.to(device), long.to(device), scaling.original_max_position_embeddings,
                       scaling.attention_factor)
        if scaling.rope_type == "yarn":
            return cls(scale_yarn(head_dim, theta, scaling).to(device), attention_factor=scaling.attention_factor)
        raise ValueError(f"unsupported rope_type {scaling.rope_type!r}")

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin [num_tokens, 1, head_dim / 2] (the two halves of Hugging Face's tables are equal)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = positions[:, None].float() * self.long_inv_freq[None, :]
            freqs = torch.where(positions[:, None] >= self.long_from, long, freqs)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class CosSinCache:
    """A RopeTables' cos and sin of every position below a capacity, computed by it once (grown, doubling, when a
    step reaches past them): on the CPU a step's cos and sin are then two row gathers instead of its ~8 ops (#29),
    with the same values (the tables are the same elementwise ops over more rows). Elsewhere, and while compiling,
    the tables' own computation."""

    MIN_CAPACITY = 4096

    def __init__(self, tables: RopeTables) -> None:
        self.tables = tables
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """As RopeTables.cos_sin: cos and sin [num_tokens, 1, head_dim / 2] of `positions`."""
        if positions.device.type != "cpu" or positions.numel() == 0 or torch.compiler.is_compiling():
            return self.tables.cos_sin(positions, dtype)
        cos, sin = self.tables_for(int(positions.max()) + 1, dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def tables_for(self, positions: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The cached cos and sin, grown to hold `positions` positions (and rebuilt for another dtype)."""
        if self.cos is None or self.sin is None or self.cos.shape[0] < positions or self.cos.dtype != dtype:
            capacity = max(self.MIN_CAPACITY, 1 << (positions - 1).bit_length())
            self.cos, self.sin = self.tables.cos_sin(torch.arange(capacity), dtype)
        return self.cos, self.sin


def default_inv_freq(dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def scale_yarn(dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    """YaRN's frequencies: extrapolated (unscaled) above the correction range's dimensions, interpolated (divided by
    the factor) below it, linearly blended inside it."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


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
