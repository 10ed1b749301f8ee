"""The model's C++ CPU ops (csrc/): linear layers over packed weights and for skinny batches (packed.py), the
fused RoPE + KV-cache write (rope_write_kv below), RMSNorm (alone or after the residual add) and the MLP's
SiLU-and-multiply, each in one pass, and a sparse MoE block's experts in one call (moe_experts). One extension,
built like the attention kernel (executor_service/kernels/build.py); where it cannot be built, the model keeps its
torch path."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch
from torch import Tensor

from executor_service.kernels.build import try_build

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = [CSRC / "packed_linear_cpu.cpp", CSRC / "skinny_linear_cpu.cpp", CSRC / "rope_kv_cpu.cpp",
           CSRC / "rms_norm_cpu.cpp", CSRC / "silu_mul_cpu.cpp", CSRC / "moe_cpu.cpp"]
CFLAGS = ("-ffp-contract=off",)  # products rounded before sums, as torch's separate ops do


@functools.cache
def sources_digest() -> str:
    """A digest of the extension's sources and flags: what a measurement of its kernels depends on."""
    digest = hashlib.sha256(repr(CFLAGS).encode())
    for path in SOURCES:
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]


@functools.cache
def load() -> bool:
    """Build (or reuse) and load the extension; False, with one warning, when it cannot be built here."""
    if hasattr(torch.ops.pagedserve_model, "rope_write_kv"):
        return True
    return try_build("pagedserve_cpu_model", SOURCES, "C++ CPU model ops", "torch", CFLAGS)


def rope_write_kv(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                  num_heads: int, num_kv_heads: int) -> Tensor:
    """Rotated queries [tokens, num_heads, head_dim] of the fused qkv rows; the rotated keys and the values written
    into the caches at slot_mapping (float32 CPU tensors, the caches float32 or float16; bit-identical to
    apply_rope + write_kv)."""
    return torch.ops.pagedserve_model.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads,
                                                    num_kv_heads)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x's rows [tokens, hidden] (float32 CPU, each row contiguous): a new contiguous tensor, equal to
    torch's rms_norm up to rounding."""
    return torch.ops.pagedserve_model.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tensor:
    """residual += x in place, then RMSNorm of the sum's rows, in one pass (as rms_norm)."""
    return torch.ops.pagedserve_model.add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of the fused gate/up projection's rows [tokens, 2 * intermediate] (float32 CPU) in one pass:
    a new contiguous [tokens, intermediate], equal to torch's up to rounding."""
    return torch.ops.pagedserve_model.silu_and_mul(gate_up)


@functools.cache
def moe_available() -> bool:
    """Whether moe_experts can run here (the extension built, with AVX-512)."""
    return load() and bool(torch.ops.pagedserve_model.has_moe())


def moe_experts(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
    """sum over each token's experts ids [T, k] of weights [T, k] * expert(x row) (gate/up, silu * up, down), over
    the experts' weights packed by model/moe.py's pack_experts (float32 CPU; equal to the torch loop up to the GEMMs'
    rounding)."""
    return torch.ops.pagedserve_model.moe_experts(x, ids, weights, w13, w2)
