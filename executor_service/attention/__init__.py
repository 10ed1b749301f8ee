"""Paged attention ops with identical signatures: a pure-torch reference, a C++ CPU kernel that reads the paged
cache in place (csrc/, built on first use, the reference where it cannot be built) and a Triton kernel."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor

from executor_service.attention.reference import Scratch, paged_attention, write_kv

WriteKVFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]
PagedAttentionFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]

ENV_VAR = "PAGEDSERVE_ATTENTION"

__all__ = ["ENV_VAR", "PagedAttentionFn", "WriteKVFn", "get_attention_ops", "paged_attention", "write_kv"]


def _triton_ops() -> tuple[WriteKVFn, PagedAttentionFn]:
    from executor_service.attention import triton_paged

    return triton_paged.write_kv, triton_paged.paged_attention


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_ops(device: torch.device | str) -> tuple[WriteKVFn, PagedAttentionFn]:
    """Pick (write_kv, paged_attention): env override, else Triton on CUDA when importable, the C++ kernel on the
    CPU when it builds, else the reference."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice == "reference":
        return _reference_ops()
    if choice == "triton":
        return _triton_ops()
    if choice == "cpu":
        return _cpu_ops(required=True)
    if choice:
        raise ValueError(f"{ENV_VAR} must be 'reference', 'cpu' or 'triton', got {choice!r}")
    kind = torch.device(device).type
    if kind == "cuda" and _triton_available():
        return _triton_ops()
    if kind == "cpu":
        return _cpu_ops(required=False)
    return _reference_ops()


def _cpu_ops(required: bool) -> tuple[WriteKVFn, PagedAttentionFn]:
    """The C++ CPU kernel (its own scratch for the step's plan); the reference if it cannot be built here,
    unless it was asked for by name."""
    from executor_service.attention import cpu

    if not cpu.load():
        if required:
            raise RuntimeError(f"{ENV_VAR}=cpu, but the CPU attention kernel could not be built (see the log)")
        return _reference_ops()
    return cpu.write_kv, functools.partial(cpu.paged_attention, scratch=Scratch())


def _reference_ops() -> tuple[WriteKVFn, PagedAttentionFn]:
    """The torch reference with gather buffers of its own, reused across the caller's calls."""
    return write_kv, functools.partial(paged_attention, scratch=Scratch())
