"""Packing a restart's linears after ready (#33): the start-up cache already knows the packing choice, so the start
leaves the weights unpacked (model/calibration.py's defer_choice: the skinny kernel up to its rows, F.linear above
them) and reports ready; a low-priority thread then packs each linear and the forward thread swaps the packs in
between steps (install(), at the start of a pass), never within one, so each pass runs on one set of weights.

A first token needs no packed weight: one row takes F.linear and 2 to skinny_rows rows the skinny kernel either
way, so the reorder of every linear weight into oneDNN's or MKL's panels (0.8 - 1.7 s for 2 GB on two cores) leaves
the path to the first token. Until a linear is swapped in, a batch of more rows computes F.linear: equal to the
packed GEMM up to rounding (as with --no-cpu-weight-prepack)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace

from executor_service.model.calibration import lower_thread_priority
from executor_service.model.packed import Gemm, PackedWeight, pack
from executor_service.model.parallel import Linear

log = logging.getLogger("pagedserve.executor")


class BackgroundPacking:
    """Packs `linears` for `gemm` on a daemon thread at the lowest priority; install() swaps in what is packed."""

    def __init__(self, linears: Sequence[Linear], gemm: Gemm) -> None:
        self.gemm = gemm
        self.todo = [(m, m.packed.skinny_rows if m.packed is not None else 0) for m in linears]
        self.ready: list[tuple[Linear, PackedWeight]] = []
        self.lock = threading.Lock()
        self.done: Future[float] = Future()
        """The seconds the packing took, once every linear is packed (not yet installed: see install())."""

    def start(self) -> BackgroundPacking:
        threading.Thread(target=self.run, name="pack-after-ready", daemon=True).start()
        return self

    def run(self) -> None:
        lower_thread_priority()
        t0 = time.perf_counter()
        try:
            for module, rows in self.todo:
                packed = replace(pack(module.weight.detach(), self.gemm), skinny_rows=rows)
                with self.lock:
                    self.ready.append((module, packed))
        except Exception as exc:  # the unpacked weights stay: correct, only slower above the skinny rows
            log.warning("packing the linear weights after ready failed (%s); they stay on F.linear", exc)
            self.done.set_exception(exc)
            return
        seconds = time.perf_counter() - t0
        log.info("linear weights packed for %s after ready, in the background: %d in %.2f s", self.gemm,
                 len(self.todo), seconds)
        self.done.set_result(seconds)

    def install(self) -> bool:
        """Swap in the packs made since the last call (on the forward thread, between passes); True once every
        linear's is in, or the packing has failed (nothing more will come)."""
        if self.ready:
            with self.lock:
                ready, self.ready = self.ready, []
            for module, packed in ready:
                module.packed = packed
        return self.done.done() and not self.ready
