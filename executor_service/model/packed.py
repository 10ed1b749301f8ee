"""Linear weights packed once into MKL's GEMM panels for the CPU (csrc/packed_linear_cpu.cpp).

torch's F.linear lets MKL re-pack the weight on every call; for decode-sized batches that is a large part of the
call (1.2 - 1.9x at 2 - 64 rows on the benchmark models' shapes). With BITWISE_ROWS rows or more the packed path
runs the same MKL kernels as F.linear and is bit-identical to it; from MIN_ROWS to BITWISE_ROWS - 1 F.linear takes
MKL's small-matrix path and the two differ by rounding only (as F.linear's own results differ between row
counts). A single row keeps F.linear: packing does not speed it up, and a batch of one then computes exactly
what transformers' one-sequence decode does. The ops live in the model's C++ extension (cpu_ops.py); where it
cannot be built, every layer keeps F.linear.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import linear

from executor_service.model import cpu_ops

MIN_ROWS = 2
BITWISE_ROWS = 16


def can_pack(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and cpu_ops.load()


def pack(weight: Tensor) -> Tensor:
    return torch.ops.pagedserve_model.pack_weight(weight)


def dense(x: Tensor, weight: Tensor, bias: Tensor | None, packed: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias); over `packed` (pack(weight)) when x is a matrix of at least MIN_ROWS rows."""
    if packed is None or x.dim() != 2 or x.shape[0] < MIN_ROWS or x.stride(1) != 1:
        return linear(x, weight, bias)
    return torch.ops.pagedserve_model.linear(x, packed, weight, bias)

