"""Packing the linears after ready (#33): the start leaves the weights unpacked (model/calibration.py's defer_choice:
the skinny kernel up to the choice's rows, F.linear above them) and reports ready; a low-priority thread then packs
each linear for the start-up cache's choice (or, on a first start, the rule's, and then measures the choice on the
model's own weights, repacks where the measurement chose otherwise and keeps it in the cache). The forward thread
swaps the packs in between passes (install(), at the start of a pass), never within one, so a pass runs on one set
of weights.

A first token needs no packed weight: one row takes F.linear and 2 to skinny_rows rows the skinny kernel either way,
so the reorder of every linear weight into oneDNN's or MKL's panels (0.8 - 1.7 s for 2 GB on two cores) leaves the
path to the first token. A pass of more rows than that (a long prompt right after ready, where F.linear would cost
up to 2 - 3.5x the packed GEMM) first packs what is left itself, at the forward thread's priority, beside the
background thread (finish_first_packs): it waits at most what packing before ready would have cost, and such passes
always run on the packed GEMM. Greedy outputs are those of a start that packed before ready."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from executor_service.model.calibration import (
    keep_thread_count,
    measure_gemm,
    measure_skinny_rows,
    store_choice,
)
from executor_service.model.packed import MIN_ROWS, Gemm, PackedWeight, Packing, can_skinny, pack, with_skinny_rows
from executor_service.model.parallel import Linear
from executor_service.placement import lower_thread_priority
from executor_service.startup import MeasureCache

log = logging.getLogger("pagedserve.executor")


class PackingStopped(Exception):
    """The backend that owns the packing was closed (or collected) before the packing finished."""


class BackgroundPacking:
    """Packs `linears` for `packing` on a daemon thread at the lowest priority (measuring the choice first where it is
    provisional: `requested`, `skinny_rows` and `cache` as for the measurement at load); install() swaps in what is
    packed. `done` has the final choice once every pack is made (not yet installed: see install())."""

    def __init__(self, linears: Sequence[Linear], packing: Packing, requested: str, skinny_rows: int,
                 cache: MeasureCache | None) -> None:
        self.linears, self.packing = list(linears), packing
        self.requested, self.skinny_rows, self.cache = requested, skinny_rows, cache
        self.latest: dict[int, PackedWeight] = {}
        """The newest pack of each linear (by id), installed or not."""
        self.queue: list[tuple[Linear, PackedWeight]] = []
        self.lock = threading.Lock()
        self.unpacked = list(reversed(self.linears)) if packing.gemm is not None else []
        """Linears not yet taken for the first packs (for packing.gemm), popped from the end in model order."""
        self.in_flight = 0
        self.first_packs = threading.Event()
        """Set once every linear's first pack is made (where there is nothing to pack: at once)."""
        if not self.unpacked:
            self.first_packs.set()
        self.done: Future[Packing] = Future()
        """Cancelled where stop() came first."""
        self.stopping = False
        """Set by stop(): a plain flag, not an Event, as stop() may run as a finalizer on any thread (this one
        included, inside an Event's lock)."""
        self.threads = torch.get_num_threads()
        """The loading thread's count, which the cache key of its choice has (keep_thread_count)."""

    def start(self) -> BackgroundPacking:
        threading.Thread(target=self.run, name="pack-after-ready", daemon=True).start()
        return self

    def run(self) -> None:
        keep_thread_count(self.threads)
        lower_thread_priority()
        t0 = time.perf_counter()
        try:
            packing = self.packing
            self.pack_unpacked()
            self.check_stopping()  # pack_unpacked left linears unpacked: nothing would set first_packs
            self.first_packs.wait()  # a pass may still be packing one: its pack comes before any repack
            if packing.provisional:
                packing = self.measure(packing)
        except PackingStopped:
            self.done.cancel()
            return
        except Exception as exc:  # what is installed stays: correct, only perhaps slower
            log.warning("packing the linear weights after ready failed (%s); keeping what is packed", exc)
            self.done.set_exception(exc)
            return
        log.info("linear weights packed for %s after ready, in the background (%.2f s): skinny kernel up to %d "
                 "rows%s", packing.gemm or "nothing (F.linear)", time.perf_counter() - t0, packing.skinny_rows,
                 f" (measured; {packing.kept})" if packing.kept else "")
        self.done.set_result(packing)

    def stop(self) -> None:
        """End the thread at its next pack or measurement (its backend is closed or collected); a pass after it
        packs nothing more (what is not packed stays on F.linear)."""
        self.stopping = True

    def check_stopping(self) -> None:
        if self.stopping:
            raise PackingStopped

    def pack_unpacked(self) -> None:
        """Make the first packs (for self.packing) of the linears no thread has taken yet; called by the background
        thread and by a pass that needs them all (finish_first_packs): each linear is taken by one of them."""
        gemm, rows = self.packing.gemm, self.packing.skinny_rows
        while gemm is not None and not self.stopping:
            with self.lock:
                if not self.unpacked:
                    return
                module = self.unpacked.pop()
                self.in_flight += 1
            try:
                self.put(module, self.with_rows(module, pack(module.weight.detach(), gemm), rows))
            finally:  # a linear whose pack failed stays on F.linear: nothing more will come for it
                with self.lock:
                    self.in_flight -= 1
                    if not self.unpacked and not self.in_flight:
                        self.first_packs.set()

    def finish_first_packs(self) -> None:
        """Pack what is left of the first packs on this thread (beside the background one) and wait for those under
        way: for a pass that would otherwise run F.linear over rows the packed GEMM does faster."""
        try:
            self.pack_unpacked()
        except Exception as exc:  # that linear stays on F.linear: correct, only slower
            log.warning("packing a linear weight before a pass failed (%s); it stays on F.linear", exc)
        with self.lock:
            all_taken = not self.unpacked  # else stopped, or failed: the rest stays on F.linear for this pass
        if all_taken:
            self.first_packs.wait()

    def needs_packs(self, rows: int) -> bool:
        """Whether a pass of `rows` rows would run F.linear where the packed GEMM would be used (more rows than the
        skinny kernel takes) while first packs are still missing."""
        return rows >= MIN_ROWS and rows > self.packing.skinny_rows and not self.first_packs.is_set() \
            and not self.stopping

    def pack_for(self, gemm: Gemm, rows: int) -> None:
        for module in self.linears:
            self.check_stopping()
            self.put(module, self.with_rows(module, pack(module.weight.detach(), gemm), rows))

    def measure(self, provisional: Packing) -> Packing:
        """The choice measured on the model's own weights (repacked where it differs from the rule's), kept in the
        start-up cache."""
        gemm = measure_gemm(self.linears, self.requested)
        if gemm is None:  # neither GEMM can run: nothing to measure (the rule found none either)
            return provisional
        if gemm != provisional.gemm:
            self.pack_for(gemm, provisional.skinny_rows)
        self.check_stopping()
        rows = measure_skinny_rows(self.linears, self.latest, self.skinny_rows)
        self.check_stopping()
        if rows != provisional.skinny_rows:
            for module in self.linears:
                self.put(module, self.with_rows(module, self.latest[id(module)], rows))
        return store_choice(self.cache, self.linears, self.requested, self.skinny_rows, Packing(gemm, rows))

    @staticmethod
    def rows_of(module: Linear, rows: int) -> int:
        return rows if can_skinny(module.weight) else 0

    def with_rows(self, module: Linear, packed: PackedWeight, rows: int) -> PackedWeight:
        """The module's pack taking the skinny kernel up to `rows` rows (its panels dropped where it never will)."""
        return with_skinny_rows(packed, module.weight.detach(), self.rows_of(module, rows))

    def put(self, module: Linear, packed: PackedWeight) -> None:
        with self.lock:
            self.latest[id(module)] = packed
            self.queue.append((module, packed))

    def install(self) -> bool:
        """Swap in the packs made since the last call (on the forward thread, between passes); True once every one
        is in, or the packing has failed (nothing more will come)."""
        if self.queue:
            with self.lock:
                ready, self.queue = self.queue, []
            for module, packed in ready:
                module.packed = packed
        return self.done.done() and not self.queue
