"""Linear weights packed once for the CPU's GEMM: MKL's panels (csrc/packed_linear_cpu.cpp) or oneDNN's blocked layout.

torch's F.linear lets MKL re-pack the weight on every call; for decode-sized batches that is a large part of the
call (1.2 - 1.9x at 2 - 64 rows on the benchmark models' shapes). Two packed GEMMs, chosen per machine
(choose_gemm times both on the model's own shapes at load; --cpu-gemm forces one):

- "mkl": MKL's panels. With BITWISE_ROWS rows or more it runs the same kernels as F.linear and is bit-identical
  to it; from MIN_ROWS to BITWISE_ROWS - 1 F.linear takes MKL's small-matrix path and the two differ by rounding.
  Best on Intel CPUs.
- "onednn": oneDNN's reordered weight (torch.ops.mkldnn). MKL runs its AVX2 code on other vendors' CPUs, while
  oneDNN JIT-compiles for the ISA it finds (AVX-512 on AMD Zen 4/5: 2 - 3.5x MKL's FLOP/s at 4 - 2,048 rows there).
  Equal to F.linear up to rounding (~1e-6 relative).

Skinny batches (MIN_ROWS to PackedWeight.skinny_rows rows) can take a third kernel instead
(csrc/skinny_linear_cpu.cpp, AVX-512 or AVX2 and FMA): it keeps the memory busy while it computes, where a decode
step of a few sequences is bound by streaming the weights from memory. pack() also lays the weight out in its panels
(64 output columns each, one more copy of the weight), over which it runs 1.1 - 1.4x faster than over the weight in
place, which it reads until the linears are packed. choose_skinny_rows times it and the packed GEMM, alternated, at
2 - 128 rows over the model's own weights at load and takes the one threshold best over all those row counts
(skinny_threshold; 0 where the weights stay in cache and it does not win); equal to F.linear up to rounding.

A single row keeps F.linear on both: packing does not speed it up, and a batch of one then computes exactly what
transformers' one-sequence decode does. Where neither can be used, every layer keeps F.linear.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor
from torch.nn.functional import linear

from executor_service.model import cpu_ops
from executor_service.startup import CACHE_VERSION, cpu_identity

MIN_ROWS = 2
BITWISE_ROWS = 16
Gemm = Literal["mkl", "onednn"]
GEMMS: tuple[Gemm, ...] = ("mkl", "onednn")
CALIBRATION_ROWS = (4, 32)
ONEDNN_MARGIN = 1.1  # oneDNN must be this much faster to give up MKL's bit-identity with F.linear
SKINNY_CALIBRATION_ROWS = (2, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128)
SKINNY_MARGIN = 1.05
SKINNY_ROUNDS = 3
SKINNY_CALIBRATION_BYTES = 256 << 20
PACK_THREADS = 4


@dataclass(frozen=True, slots=True)
class PackedWeight:
    gemm: Gemm
    panels: Tensor | None
    """None until the weight is packed (a start that packs after ready): batches of more than skinny_rows rows
    take F.linear meanwhile."""
    skinny_rows: int = 0
    skinny_panels: Tensor | None = None
    """The weight in the skinny kernel's panels (pack_skinny_panels), which dense() takes up to skinny_rows rows;
    None: the skinny kernel over the weight in place."""


@dataclass(frozen=True, slots=True)
class Packing:
    """What a model's linears were packed for: the GEMM (None: F.linear) and the skinny kernel's most rows."""

    gemm: Gemm | None
    skinny_rows: int
    cached: bool = False
    """Whether the choice came from the start-up cache (not measured at this start)."""
    provisional: bool = False
    """Whether the choice is model/calibration.py's rule, to be measured after the start."""
    deferred: bool = False
    """Whether the linears are left unpacked (the skinny kernel's rows set) and packed after ready."""
    kept: str = ""
    """A choice measured at this start: whether the start-up cache kept it ("kept for the next start") or why not
    ("not kept: ..."); "" where nothing was measured."""


def can_pack(weight: Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


def can_skinny(weight: Tensor) -> bool:
    return (can_pack(weight) and weight.is_contiguous() and weight.shape[1] > 0 and weight.shape[1] % 16 == 0
            and weight.shape[0] % 4 == 0)


@functools.cache
def skinny_available() -> bool:
    return cpu_ops.load() and bool(torch.ops.pagedserve_model.has_skinny())


def available(gemm: Gemm) -> bool:
    if gemm == "onednn":
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    return cpu_ops.load()


def pack(weight: Tensor, gemm: Gemm = "mkl") -> PackedWeight:
    """The weight packed for `gemm` and, where the skinny kernel can take it, in the skinny kernel's panels."""
    panels = skinny_panels_of(weight)
    if gemm == "onednn":
        if weight.dtype != torch.float32:
            raise RuntimeError(f"packed weights must be float32, got {weight.dtype}")
        return PackedWeight(gemm, torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None),
                            skinny_panels=panels)
    return PackedWeight(gemm, torch.ops.pagedserve_model.pack_weight(weight), skinny_panels=panels)


def skinny_panels_of(weight: Tensor) -> Tensor | None:
    """The weight in the skinny kernel's panels; None where the kernel cannot take it."""
    return torch.ops.pagedserve_model.pack_skinny_panels(weight) if can_skinny(weight) and skinny_available() \
        else None


def with_skinny_rows(packed: PackedWeight, weight: Tensor, rows: int) -> PackedWeight:
    """packed taking the skinny kernel up to `rows` rows: its panels kept (packed again if dropped) where dense()
    can take them, dropped where it never will (rows below MIN_ROWS), as they are one more copy of the weight."""
    if rows < MIN_ROWS:
        return replace(packed, skinny_rows=rows, skinny_panels=None)
    panels = packed.skinny_panels if packed.skinny_panels is not None else skinny_panels_of(weight)
    return replace(packed, skinny_rows=rows, skinny_panels=panels)


class Packable(Protocol):
    """What pack_all needs of a linear layer (model/parallel.py's Linear)."""

    def pack_weight(self, gemm: Gemm) -> None: ...


def pack_all(linears: Sequence[Packable], gemm: Gemm) -> None:
    """Pack these linears' weights for `gemm`, spread over PACK_THREADS threads (the reorders are independent and
    release the GIL; each is one pass over its weight)."""
    threads = min(PACK_THREADS, os.cpu_count() or 1, len(linears))
    if threads <= 1:
        for module in linears:
            module.pack_weight(gemm)
        return
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="pack") as pool:
        list(pool.map(lambda m: m.pack_weight(gemm), linears))


def packing_key(shapes: list[tuple[int, int]], skinny_shapes: list[tuple[int, int]], count: int, requested: str,
                skinny_rows: int) -> dict[str, Any]:
    """Everything choose_gemm and choose_skinny_rows depend on: the CPU, torch (and its oneDNN and MKL), the
    kernels' sources, the thread count, the requested settings and the model's linear shapes."""
    return {
        "version": CACHE_VERSION,
        "cpu": cpu_identity(),
        "torch": torch.__version__,
        "onednn": str(torch.backends.mkldnn.is_available()),
        "kernels": cpu_ops.sources_digest(),
        "threads": torch.get_num_threads(),
        "requested": requested,
        "skinny_rows": skinny_rows,
        "skinny_calibration": [*SKINNY_CALIBRATION_ROWS, SKINNY_MARGIN, SKINNY_ROUNDS],
        "shapes": [list(s) for s in shapes],
        "skinny_shapes": [list(s) for s in skinny_shapes],
        "linears": count,
    }


def dense(x: Tensor, weight: Tensor, bias: Tensor | None, packed: PackedWeight | None) -> Tensor:
    """F.linear(x, weight, bias); over `packed` (pack(weight)) when x is a matrix of at least MIN_ROWS rows, with the
    skinny kernel up to packed.skinny_rows rows (and F.linear above them while packed.panels is None)."""
    if packed is None or x.dim() != 2 or x.shape[0] < MIN_ROWS or x.stride(1) != 1:
        return linear(x, weight, bias)
    if x.shape[0] <= packed.skinny_rows and x.is_contiguous():
        if packed.skinny_panels is not None:
            return torch.ops.pagedserve_model.skinny_panel_linear(x, packed.skinny_panels, weight.shape[0], bias)
        return torch.ops.pagedserve_model.skinny_linear(x, weight, bias)
    if packed.panels is None:
        return linear(x, weight, bias)
    if packed.gemm == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed.panels, bias, "none", [], "")
    return torch.ops.pagedserve_model.linear(x, packed.panels, weight, bias)


def choose_gemm(shapes: list[tuple[int, int]], requested: str = "auto",
                weights: dict[tuple[int, int], Tensor] | None = None) -> Gemm | None:
    """The packed GEMM to use for linears of these (in, out) shapes: `requested` if it is one (and can run here),
    else the faster of the two on these shapes at CALIBRATION_ROWS rows (MKL unless oneDNN is clearly faster);
    None if neither can run. `weights` (one per shape, the model's own) spares making random ones."""
    if requested != "auto":
        forced = next((g for g in GEMMS if g == requested), None)
        if forced is None:
            raise ValueError(f"cpu_gemm must be auto, mkl or onednn, got {requested!r}")
        return forced if available(forced) else None
    usable = [g for g in GEMMS if available(g)]
    if len(usable) < 2:
        return usable[0] if usable else None
    seconds = {g: gemm_seconds(g, shapes, weights=weights) for g in usable}
    return "onednn" if seconds["onednn"] * ONEDNN_MARGIN < seconds["mkl"] else "mkl"


def gemm_seconds(gemm: Gemm, shapes: list[tuple[int, int]], rounds: int = 3,
                 weights: dict[tuple[int, int], Tensor] | None = None) -> float:
    """Best time of one pass of these linears at each of CALIBRATION_ROWS rows, packed for `gemm`."""
    gen = torch.Generator().manual_seed(0)
    given = weights or {}
    tensors = [given[(i, o)] if (i, o) in given else torch.randn(o, i, generator=gen) for i, o in shapes]
    packs = [pack(w, gemm) for w in tensors]
    inputs = [torch.randn(m, i, generator=gen) for m in CALIBRATION_ROWS for i, _ in shapes]
    operands = list(zip(inputs, tensors * len(CALIBRATION_ROWS), packs * len(CALIBRATION_ROWS), strict=True))

    def one_pass() -> None:
        for x, w, p in operands:
            dense(x, w, None, p)

    return best_seconds(one_pass, rounds)


def choose_skinny_rows(weights: list[Tensor], packs: list[PackedWeight], requested: int = -1) -> int:
    """Rows up to which dense() takes the skinny kernel for these weights (can_skinny) and their packs: `requested`
    if >= 0, else skinny_threshold of one pass over all of them (as a decode step reads them: from memory when they
    outgrow the caches) with each at every one of SKINNY_CALIBRATION_ROWS, the two timed in alternation; 0 if the
    kernel cannot run here."""
    if requested < -1:
        raise ValueError(f"cpu_skinny_rows must be -1 (auto), 0 (off) or a row count, got {requested}")
    if not weights or not skinny_available():
        return 0
    if requested >= 0:
        return requested
    weights, packs = calibration_subset(weights, packs)
    # the panels packed once for all row counts (a pack may have dropped them), the GEMM's passes not taking them
    gemm_packs = [replace(with_skinny_rows(p, w, MIN_ROWS), skinny_rows=0) for w, p in zip(weights, packs, strict=True)]
    return skinny_threshold({m: pair_seconds(weights, gemm_packs, m) for m in SKINNY_CALIBRATION_ROWS})


def skinny_threshold(seconds: dict[int, tuple[float, float]]) -> int:
    """The row count t (0 or one of `seconds`' keys) whose rule "the skinny kernel up to t rows, the packed GEMM
    above" is best over all of them: the least sum over the rows up to t of log(SKINNY_MARGIN * skinny / gemm), from
    each row count's (skinny, gemm) seconds. One noisy win (or loss) among clear losses (wins) does not move t, as
    taking the most rows that win would; a tie goes to the GEMM."""
    best, best_score, score = 0, 0.0, 0.0
    for rows in sorted(seconds):
        skinny, gemm = seconds[rows]
        score += math.log(SKINNY_MARGIN * skinny / gemm)
        if score < best_score:
            best, best_score = rows, score
    return best


def calibration_subset(weights: list[Tensor], packs: list[PackedWeight]
                       ) -> tuple[list[Tensor], list[PackedWeight]]:
    """The first weights (in the model's order: whole layers, the LM head last) up to calibration_bytes(): enough
    to outgrow the CPU's caches, as a decode step's pass over all of them does, at a fraction of the time of
    timing all of a large model's weights. Models smaller than that are timed whole."""
    count, total, limit = 0, 0, calibration_bytes()
    while count < len(weights) and (count == 0 or total < limit):
        total += weights[count].numel() * weights[count].element_size()
        count += 1
    return weights[:count], packs[:count]


def calibration_bytes() -> int:
    """SKINNY_CALIBRATION_BYTES, or twice the largest CPU cache where that is larger (Linux's sysfs)."""
    return max(SKINNY_CALIBRATION_BYTES, 2 * largest_cache_bytes())


@functools.cache
def largest_cache_bytes() -> int:
    sizes = [0]
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip() if path.is_file() else ""
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes)


def pair_seconds(weights: list[Tensor], packs: list[PackedWeight], rows: int, rounds: int = SKINNY_ROUNDS
                 ) -> tuple[float, float]:
    """Best times of one pass over these linears at `rows` rows with the skinny kernel (over the packs' panels, as
    dense() takes it) and with the packed GEMM, the two alternated round by round (the machine's swings reach both
    alike)."""
    gen = torch.Generator().manual_seed(0)
    inputs = {i: torch.randn(rows, i, generator=gen) for i in {w.shape[1] for w in weights}}

    skinny_packs = [with_skinny_rows(p, w, rows) for w, p in zip(weights, packs, strict=True)]

    def skinny_pass() -> None:
        for w, p in zip(weights, skinny_packs, strict=True):
            dense(inputs[w.shape[1]], w, None, p)

    def gemm_pass() -> None:
        for w, p in zip(weights, packs, strict=True):
            dense(inputs[w.shape[1]], w, None, p)

    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, run in enumerate((skinny_pass, gemm_pass)):
            best[i] = min(best[i], best_seconds(run, 1))
    return best[0], best[1]


def best_seconds(run: Callable[[], None], rounds: int) -> float:
    """Best time of `rounds` calls of `run` after one warm-up call (this thread's CPU time when torch runs one
    thread)."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = float("inf")
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            start = clock()
            run()
            best = min(best, clock() - start)
    return best
