"""The packing measurement of a cold start, run after ready on a low-priority background thread (#33): the executor
serves on the provisional packing (model/calibration.py) meanwhile, and the measured choice is swapped in and kept
in the start-up cache for the next start."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from executor_service.model import LlamaForCausalLM
from executor_service.model.calibration import keep_thread_count
from executor_service.model.packed import Packing
from executor_service.placement import lower_thread_priority
from executor_service.startup import MeasureCache

log = logging.getLogger("pagedserve.executor")


def finished(packing: Packing) -> Future[Packing]:
    future: Future[Packing] = Future()
    future.set_result(packing)
    return future


def start_calibration(model: LlamaForCausalLM, requested: str, skinny_rows: int,
                      cache: MeasureCache) -> Future[Packing]:
    """Measure the packing choice on a daemon thread at the lowest priority; the future has the measured choice."""
    future: Future[Packing] = Future()
    threads = torch.get_num_threads()  # the loading thread's count, which its cache key has

    def run() -> None:
        keep_thread_count(threads)
        lower_thread_priority()
        try:
            with torch.inference_mode():
                packing = model.calibrate_packing(requested, skinny_rows, cache)
        except Exception as exc:  # the provisional packing stays: it is correct, only perhaps slower
            log.warning("packing calibration failed (%s); keeping the provisional choice", exc)
            future.set_exception(exc)
            return
        kept = f" ({packing.kept})" if packing.kept else ""
        log.info("linear weights packing measured: %s, skinny kernel up to %d rows%s",
                 packing.gemm or "nothing (F.linear)", packing.skinny_rows, kept)
        future.set_result(packing)

    threading.Thread(target=run, name="calibrate", daemon=True).start()
    return future
