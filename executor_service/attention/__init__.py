"""Paged attention ops: a pure-torch reference and a Triton kernel with identical signatures."""

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
    """Pick (write_kv, paged_attention): env override, else Triton on CUDA when importable."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice == "reference":
        return _reference_ops()
    if choice == "triton":
        return _triton_ops()
    if choice:
        raise ValueError(f"{ENV_VAR} must be 'reference' or 'triton', got {choice!r}")
    if torch.device(device).type == "cuda" and _triton_available():
        return _triton_ops()
    return _reference_ops()


def _reference_ops() -> tuple[WriteKVFn, PagedAttentionFn]:
    """The torch reference with gather buffers of its own, reused across the caller's calls."""
    return write_kv, functools.partial(paged_attention, scratch=Scratch())
