"""The CPU paged-attention kernel (csrc/paged_attention_cpu.cpp): built once per machine, loaded on demand.

`load()` compiles the C++ source (executor_service/kernels/build.py: g++ -O3 -march=native, cached per source,
torch version and CPU flags in PAGEDSERVE_KERNEL_DIR), or loads an earlier build. It returns False, once, with
a warning, when the kernel cannot be built (no compiler): callers then use the pure-torch reference. `python -m
executor_service.attention.cpu` builds it ahead of time (scripts/setup.sh builds every CPU extension with
`python -m executor_service.kernels`).

The kernel takes float32 queries over float32 or float16 caches (`--kv-cache-dtype float16`: rows widened as they
are read, rounded to nearest even as they are written); `paged_attention` below sends it decode-like sequences,
short chunks (query length <= KERNEL_MAX_QUERY) and longer chunks whose cached prefix is under
KERNEL_MAX_PREFIX_SHARE of their length (whole prompts: the kernel skips the masked half of the causal square, which
the padded SDPA computes; 1.6 - 2.6x faster), and the rest (chunks behind a long prefix, mostly a rectangle of
scores, where the reference's batched SDPA is faster: BENCHMARKS.md section 8) to the reference, in one output
tensor.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from executor_service.attention.reference import Plan, Scratch, build_plan, run_plan
from executor_service.kernels.build import kernel_dir, try_build

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
KERNEL_MAX_QUERY = 32
KERNEL_MAX_PREFIX_SHARE = 1 / 3


@dataclass(slots=True)
class Split:
    """A step's sequences: those the kernel computes (None: none) and the reference's plan for the rest."""

    kernel_seqs: Tensor | None
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    plan: Plan


CACHE_DTYPES = (torch.float32, torch.float16)  # what the kernel reads and writes


def plan_split(query: Tensor, k_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
               query_start_loc: Tensor) -> Split:
    tables, lens, starts = (t.to(torch.int32).contiguous() for t in (block_tables, seq_lens, query_start_loc))
    q_lens = starts[1:] - starts[:-1]
    has_queries = q_lens > 0
    mostly_causal = (lens - q_lens).float() < KERNEL_MAX_PREFIX_SHARE * q_lens
    to_kernel = has_queries & ((q_lens <= KERNEL_MAX_QUERY) | mostly_causal)
    kernel_seqs = to_kernel.nonzero().flatten().to(torch.int32)
    rest = (has_queries & ~to_kernel).nonzero().flatten().tolist()
    plan = Plan([], query.shape[0]) if not rest else build_plan(query, k_cache, block_tables, seq_lens,
                                                                query_start_loc, rest)
    return Split(kernel_seqs if kernel_seqs.numel() else None, tables, lens, starts, plan)


@functools.cache
def load() -> bool:
    """Build (or reuse) and load the kernel; False when it cannot be built here."""
    if hasattr(torch.ops.pagedserve_cpu, "paged_attention"):
        return True
    return try_build("pagedserve_cpu_attention", [SOURCE], "CPU attention kernel", "the torch reference")


def supports(query: Tensor, k_cache: Tensor) -> bool:
    """float32 queries over a float32 or float16 cache (--kv-cache-dtype float16) on the CPU."""
    return query.device.type == "cpu" and query.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """The reference's write_kv in one C++ pass (float32 CPU tensors; others go to the reference)."""
    if not supports(key, k_cache) or value.dtype != torch.float32:
        from executor_service.attention.reference import write_kv as reference_write

        reference_write(key, value, k_cache, v_cache, slot_mapping)
        return
    torch.ops.pagedserve_cpu.write_kv(key, value, k_cache, v_cache, slot_mapping.long())


def paged_attention(query: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
                    query_start_loc: Tensor, scale: float, scratch: Scratch | None = None) -> Tensor:
    """Same contract as reference.paged_attention; K/V of decode-like sequences are read in place."""
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return torch.empty_like(query)
    if not supports(query, k_cache):
        from executor_service.attention.reference import paged_attention as reference_attention

        return reference_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, scratch)
    scratch = scratch if scratch is not None else Scratch()
    split = scratch.plan((block_tables, seq_lens, query_start_loc),
                         functools.partial(plan_split, query, k_cache, block_tables, seq_lens, query_start_loc))
    out = torch.empty(query.shape, dtype=torch.float32)
    if split.kernel_seqs is not None:
        torch.ops.pagedserve_cpu.paged_attention(out, query, k_cache, v_cache, split.block_tables, split.seq_lens,
                                                 split.query_start_loc, split.kernel_seqs, scale)
    if split.plan.groups:
        run_plan(split.plan, query, k_cache, v_cache, scale, scratch, out)
    return out


def main() -> int:
    """Build the kernel ahead of time (scripts/setup.sh); exit status 1 if it cannot be built here."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ok = load()
    print(f"CPU attention kernel: {'built' if ok else 'NOT built (the torch reference will be used)'}"
          f" in {kernel_dir()}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
