"""Linear weights packed once into MKL's GEMM panels for the CPU (csrc/packed_linear_cpu.cpp).

torch's F.linear lets MKL re-pack the weight on every call; for decode-sized batches that is a large part of the
call (1.2 - 1.9x at 2 - 64 rows on the benchmark models' shapes). With BITWISE_ROWS rows or more the packed path
runs the same MKL kernels as F.linear and is bit-identical to it; from MIN_ROWS to BITWISE_ROWS - 1 F.linear takes
MKL's small-matrix path and the two differ by rounding only (as F.linear's own results differ between row
counts). A single row keeps F.linear: packing does not speed it up, and a batch of one then computes exactly
what transformers' one-sequence decode does. The extension is built like the attention kernel
(executor_service/cpu_build.py); where it cannot be built, every layer keeps F.linear.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import Tensor
from torch.nn.functional import linear

from executor_service.cpu_build import build_extension

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "packed_linear_cpu.cpp"
MIN_ROWS = 2
BITWISE_ROWS = 16


@functools.cache
def load() -> bool:
    """Build (or reuse) and load the extension; False, with one warning, when it cannot be built here."""
    if hasattr(torch.ops.pagedserve_linear, "linear"):
        return True
    try:
        build_extension("pagedserve_cpu_linear", [SOURCE])
    except Exception as e:  # any build failure means: keep F.linear
        log.warning("packed CPU linear unavailable (%s); using F.linear", str(e).splitlines()[0])
        return False
    return True


def can_pack(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and load()


def pack(weight: Tensor) -> Tensor:
    return torch.ops.pagedserve_linear.pack_weight(weight)


def dense(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias); over `packed` (pack(weight)) when x is a matrix of at least MIN_ROWS rows."""
    if packed is None or x.dim() != 2 or x.shape[0] < MIN_ROWS or x.stride(1) != 1:
        return linear(x, weight, bias)
    return torch.ops.pagedserve_linear.linear(x, packed, weight, bias)

