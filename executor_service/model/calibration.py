"""How a model's linears are packed (#33): the start-up cache's choice, else measured (model/packed.py's choose_gemm
and choose_skinny_rows), either at once or, to keep the measurement off a cold start's critical path, after a
provisional choice made by a rule from the CPU and the weights' size.

The provisional rule: oneDNN where the CPU is not Intel's and has AVX-512 (MKL runs its AVX2 code there), MKL
otherwise; the skinny kernel up to PROVISIONAL_SKINNY_ROWS rows where the weights outgrow the CPU's caches (a decode
step then streams them from memory, where the kernel wins: 24 - 48 rows measured on the benchmark models), off where
they stay in cache. calibrate() then measures in the background and swaps its choice in, layer by layer: a swap is
one attribute assignment, so a forward pass running meanwhile uses the old or the new pack of each linear, and both
compute F.linear up to rounding.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from executor_service.model.packed import (
    GEMMS,
    PACK_THREADS,
    Gemm,
    PackedWeight,
    Packing,
    available,
    calibration_bytes,
    can_skinny,
    choose_gemm,
    choose_skinny_rows,
    pack_all,
    packing_key,
    skinny_available,
)
from executor_service.model.parallel import Linear
from executor_service.startup import MeasureCache

PROVISIONAL_SKINNY_ROWS = 32


def packing_key_of(linears: Sequence[Linear], requested: str, skinny_rows: int) -> dict[str, Any] | None:
    """The cache key of these linears' choice; None where nothing is measured (both settings forced)."""
    if requested != "auto" and skinny_rows != -1:
        return None
    shapes = sorted({(m.weight.shape[1], m.weight.shape[0]) for m in linears})
    skinny_shapes = sorted({(m.weight.shape[1], m.weight.shape[0]) for m in linears if can_skinny(m.weight)})
    return packing_key(shapes, skinny_shapes, len(linears), requested, skinny_rows)


def stored_choice(cache: MeasureCache | None, key: dict[str, Any] | None, skinny_rows: int) -> Packing | None:
    """The cache's choice for this key, None where there is none to trust."""
    stored = cache.get("packing", key) if cache is not None and key is not None else None
    if stored is None or stored.get("gemm") not in (*GEMMS, None):
        return None
    gemm: Gemm | None = stored.get("gemm")
    rows = int(stored.get("skinny_rows", 0)) if skinny_rows == -1 else skinny_rows
    return Packing(gemm, rows if gemm is not None and skinny_available() else 0, cached=True)


def provisional_choice(linears: Sequence[Linear], requested: str, skinny_rows: int) -> Packing:
    """The rule's choice (no timing): see the module's docstring."""
    gemm = choose_gemm([], requested) if requested != "auto" else rule_gemm()
    if gemm is None or not skinny_available():
        return Packing(gemm, 0, provisional=True)
    if skinny_rows >= 0:
        return Packing(gemm, skinny_rows, provisional=True)
    weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears if can_skinny(m.weight))
    rows = PROVISIONAL_SKINNY_ROWS if weight_bytes > calibration_bytes() else 0
    return Packing(gemm, rows, provisional=True)


def rule_gemm() -> Gemm | None:
    usable = [g for g in GEMMS if available(g)]
    if len(usable) < 2:
        return usable[0] if usable else None
    return "onednn" if cpu_vendor() != "GenuineIntel" and "avx512f" in cpu_flag_set() else "mkl"


def apply_choice(linears: Sequence[Linear], packing: Packing) -> None:
    """Pack every linear for packing.gemm (where it is not packed for it already) and set its skinny rows."""
    if packing.gemm is None:
        for module in linears:
            module.packed = None
        return
    pack_all([m for m in linears if m.packed is None or m.packed.panels is None or m.packed.gemm != packing.gemm],
             packing.gemm)
    for module in linears:
        if module.packed is not None and can_skinny(module.weight):
            module.allow_skinny(module.packed, packing.skinny_rows)


def defer_choice(linears: Sequence[Linear], packing: Packing) -> Packing:
    """Leave the linears unpacked (to be packed after ready) with the choice's skinny rows: until a linear is packed,
    dense() takes the skinny kernel up to those rows (as it will after) and F.linear above them."""
    for module in linears:
        rows = packing.skinny_rows if can_skinny(module.weight) else 0
        module.packed = PackedWeight(packing.gemm, None, rows) if packing.gemm is not None else None
    return replace(packing, deferred=packing.gemm is not None)


def measure_gemm(linears: Sequence[Linear], requested: str) -> Gemm | None:
    """choose_gemm on the linears' shapes, timed on their own weights."""
    shapes = sorted({(m.weight.shape[1], m.weight.shape[0]) for m in linears})
    own = {(m.weight.shape[1], m.weight.shape[0]): m.weight.detach() for m in linears}
    return choose_gemm(shapes, requested, own)


def measure_skinny_rows(linears: Sequence[Linear], packs: dict[int, PackedWeight], skinny_rows: int) -> int:
    """choose_skinny_rows over the linears that can take the skinny kernel and have a pack in `packs` (by id)."""
    skinny = [m for m in linears if can_skinny(m.weight) and id(m) in packs]
    return choose_skinny_rows([m.weight.detach() for m in skinny], [packs[id(m)] for m in skinny], skinny_rows)


def store_choice(cache: MeasureCache | None, linears: Sequence[Linear], requested: str, skinny_rows: int,
                 packing: Packing) -> Packing:
    """Keep a measured choice in the start-up cache for the next start; the choice says whether it was kept (kept)."""
    key = packing_key_of(linears, requested, skinny_rows)
    if key is None:  # both settings forced: nothing was measured
        return packing
    why_not = "the start-up cache is off" if cache is None else \
        cache.put("packing", key, {"gemm": packing.gemm, "skinny_rows": packing.skinny_rows})
    return replace(packing, kept=f"not kept: {why_not}" if why_not else "kept for the next start")


def measure_choice(linears: Sequence[Linear], requested: str, skinny_rows: int) -> Packing:
    """Measure the GEMM on the linears' own weights, pack them for it (apply_choice), then measure the skinny
    kernel's rows against those packs and let the linears use it."""
    gemm = measure_gemm(linears, requested)
    current = next((m.packed.skinny_rows for m in linears if m.packed is not None and m.packed.gemm == gemm), 0)
    apply_choice(linears, Packing(gemm, current))
    if gemm is None:
        return Packing(None, 0)
    rows = measure_skinny_rows(linears, {id(m): m.packed for m in linears if m.packed is not None}, skinny_rows)
    apply_choice(linears, Packing(gemm, rows))
    return Packing(gemm, rows)


def calibrate(linears: Sequence[Linear], requested: str, skinny_rows: int, cache: MeasureCache | None) -> Packing:
    """measure_choice, kept in the cache for the next start."""
    return store_choice(cache, linears, requested, skinny_rows, measure_choice(linears, requested, skinny_rows))


def planned_choice(linears: Sequence[Linear], requested: str, skinny_rows: int, cache: MeasureCache | None,
                   measure_later: bool) -> Packing | None:
    """The choice without timing anything: the cache's, the forced settings', else (measure_later) the rule's;
    None where it must be measured now."""
    key = packing_key_of(linears, requested, skinny_rows)
    choice = stored_choice(cache, key, skinny_rows)
    if choice is None and key is None:
        choice = Packing(choose_gemm([], requested), skinny_rows if skinny_available() else 0)
    if choice is None and measure_later:
        choice = provisional_choice(linears, requested, skinny_rows)
    return choice


def choose_packing(linears: Sequence[Linear], requested: str, skinny_rows: int, cache: MeasureCache | None,
                   measure_later: bool) -> Packing:
    """Pack the linears: as the cache says, else (measure_later) by the rule, to be calibrated later, else as
    measured now (and cached)."""
    choice = planned_choice(linears, requested, skinny_rows, cache, measure_later)
    if choice is None:
        return calibrate(linears, requested, skinny_rows, cache)
    apply_choice(linears, choice)
    return choice


class PackWhileReading:
    """The loader's on_file hook: packs each linear once the loader has filled its weight, on threads beside the
    reading (one core fewer than the machine has, so the reading keeps one; #33), for the choice planned_choice
    makes (the cache's, the forced settings', else the rule's). finish() waits for the packs under way, packs what
    is left and sets the skinny kernel's rows.

    With `defer`, the cache's or the rule's choice is not packed here at all: finish() sets each linear's skinny
    rows over an unpacked weight (defer_choice) and the runner packs (and measures the rule's choice) after ready
    (runner/background_packing.py)."""

    def __init__(self, requested: str, skinny_rows: int, cache: MeasureCache | None, defer: bool = False) -> None:
        self.requested, self.skinny_rows, self.cache, self.defer = requested, skinny_rows, cache, defer
        self.packing: Packing | None = None
        beside = max(1, min(PACK_THREADS, (os.cpu_count() or 1) - 1))  # a core is left to the reading
        self.pool = ThreadPoolExecutor(max_workers=beside, thread_name_prefix="pack")
        self.submitted: dict[int, Future[None]] = {}

    def __call__(self, model: Any, filled: set[str]) -> None:
        linears = model.packable_linears()
        if self.packing is None:
            self.packing = self.plan(linears)
        gemm = self.packing.gemm if self.packing is not None else None
        if gemm is None or self.deferring(self.packing):
            return
        names = {id(p): name for name, p in model.named_parameters()}
        for module in linears:
            if id(module) not in self.submitted and names.get(id(module.weight)) in filled:
                self.submitted[id(module)] = self.pool.submit(module.pack_weight, gemm)

    def finish(self, linears: Sequence[Linear]) -> Packing:
        """Wait for the packs under way (raising a pack's error), then pack the rest on all of pack_all's threads
        (the reading is over) and set the skinny rows."""
        try:
            for future in self.submitted.values():
                if not future.cancel():
                    future.result()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
        packing = self.packing or self.plan(linears)
        if self.deferring(packing):
            return defer_choice(linears, packing)
        apply_choice(linears, packing)
        return packing

    def deferring(self, packing: Packing | None) -> bool:
        """Whether the packing waits until after ready: asked for, and the choice is the cache's or the rule's (to
        be measured after ready), not one forced by the settings."""
        return self.defer and packing is not None and (packing.cached or packing.provisional) \
            and packing.gemm is not None

    def plan(self, linears: Sequence[Linear]) -> Packing:
        """planned_choice (which always chooses with measure_later); nothing to pack where no linear can be."""
        choice = planned_choice(linears, self.requested, self.skinny_rows, self.cache, True) if linears else None
        return choice or Packing(None, 0)


@functools.cache
def cpu_vendor() -> str:
    return cpuinfo_field("vendor_id")


@functools.cache
def cpu_flag_set() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags").split())


def cpuinfo_field(name: str) -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == name:
                return value.strip()
    return ""


def keep_thread_count(threads: int) -> None:
    """Run this thread's torch ops on `threads` intra-op threads. A thread takes torch's process-wide count at its
    first torch call and keeps it, so a background thread started after the count changed on another thread would
    measure at another count than the loading thread's, and key its measurement (packing_key's "threads") so that
    the next start, which looks the key up on its loading thread, never finds it."""
    torch.set_num_threads(threads)


