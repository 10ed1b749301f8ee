"""The linear weights' packing, done after ready on a background thread (#33): the executor serves on F.linear until
each linear's pack is assigned (one attribute assignment per linear, model/calibration.py), and a cold start then
measures its choice at the lowest priority, swaps the measured choice in and keeps it in the start-up cache for the
next start."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import torch

from executor_service.model import LlamaForCausalLM
from executor_service.model.calibration import lower_thread_priority
from executor_service.model.packed import Packing
from executor_service.startup import MeasureCache

log = logging.getLogger("pagedserve.executor")


def finished(packing: Packing) -> Future[Packing]:
    future: Future[Packing] = Future()
    future.set_result(packing)
    return future


def start_packing(model: LlamaForCausalLM, packing: Packing, requested: str, skinny_rows: int,
                  cache: MeasureCache) -> tuple[Future[Packing], Future[Packing]]:
    """On a daemon thread: pack the linears for `packing`, then, where it is the provisional rule's, measure the
    choice at the lowest priority and swap it in. Futures: the packing done, and all of the thread's work done (the
    measured choice where it measured)."""
    packed: Future[Packing] = Future()
    done: Future[Packing] = Future()

    def run() -> None:
        try:
            with torch.inference_mode():
                pack(model, packing)
                packed.set_result(packing)
                done.set_result(calibrate(model, requested, skinny_rows, cache) if packing.provisional else packing)
        except Exception as exc:  # F.linear (or the packs made so far) stays: correct, only perhaps slower
            log.warning("linear weight packing failed (%s); serving on what is packed", exc)
            for future in (packed, done):
                if not future.done():
                    future.set_exception(exc)

    threading.Thread(target=run, name="pack", daemon=True).start()
    return packed, done


def pack(model: LlamaForCausalLM, packing: Packing) -> None:
    t0 = time.perf_counter()
    model.apply_packing(packing)
    log.info("linear weights packed for %s in %.2f s after ready (F.linear until then); skinny kernel up to %d rows",
             packing.gemm or "nothing (F.linear)", time.perf_counter() - t0, packing.skinny_rows)


def calibrate(model: LlamaForCausalLM, requested: str, skinny_rows: int, cache: MeasureCache) -> Packing:
    lower_thread_priority()
    measured = model.calibrate_packing(requested, skinny_rows, cache)
    log.info("linear weights packing measured: %s, skinny kernel up to %d rows (kept for the next start)",
             measured.gemm or "nothing (F.linear)", measured.skinny_rows)
    return measured
