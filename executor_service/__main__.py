"""python -m executor_service --listen HOST:PORT [--model DIR | --simulated] [--tensor-parallel-size N] ..."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING

import uvloop

from client.port_file import PortFile, check_port_file
from executor_service.activity import StepActivity
from executor_service.auth import load_or_create_secret
from executor_service.backend import Backend
from executor_service.config import ExecutorConfig
from executor_service.deferred_imports import (
    DeferredImports,
    defer_torch_imports,
    lock_holder_is_awaited,
    run_in_background,
)
from executor_service.placement import bind_cores, lower_thread_priority, omp_environment, set_omp_environment
from executor_service.prefetch import cache_for, conversion_for, finish_prefetch, prefetch_weights
from executor_service.server import Serving, start_serving
from executor_service.startup import process_start_time
from executor_service.validator import StepLimits
from protos.wire import server_credentials

if TYPE_CHECKING:
    from collections.abc import Callable

    from executor_service.converted import ConvertedWeights

log = logging.getLogger("pagedserve.executor")
FREEZE_HEAP_AFTER_S = 2.0
MAX_PAUSE_S = 10.0
QUIET_WAIT_LIMIT_S = 60.0


def build_backend(config: ExecutorConfig, converted: ConvertedWeights | None = None) -> Backend:
    """The simulated or the torch backend; `converted`: the checkpoint's tensors widened while torch imported."""
    if config.simulated:
        from executor_service.simulated import SimulatedBackend
        return SimulatedBackend(config)
    from executor_service.placement import place
    from executor_service.runner.torch_backend import TorchBackend
    if config.device != "cuda":
        place(config.cpu_threads, config.cpu_cores)
    return TorchBackend.create(config, converted=converted)


async def main(config: ExecutorConfig, backend: Backend | None = None,
               converted: ConvertedWeights | None = None, deferred: DeferredImports | None = None) -> None:
    """Serve the Executor API until SIGINT/SIGTERM; `backend` is rank 0's under tensor parallelism. Without one,
    the port is open (Describe waits, health NOT_SERVING) while the model loads on another thread (`converted`:
    the prefetch thread's float32 tensors, for the loader; `deferred`: torch's imports left until after ready)."""
    credentials = None
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise SystemExit("--tls-cert and --tls-key go together")
        credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_ca)
    bind_cores(config.cpu_cores)  # before the server's and the loader's threads start: they inherit it
    stop = asyncio.Event()
    step_log = open(config.step_log, "a", buffering=1, encoding="utf-8") if config.step_log else None  # noqa: SIM115
    limits = StepLimits(max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs)
    serving = await start_serving(config.listen, credentials, load_or_create_secret(config.executor_secret_file),
                                  stop, step_log, limits)
    PortFile(config.port_file).record("listen", serving.port)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        backend = backend or await load_until_stopped(config, stop, converted)
        if backend is not None:
            await ready(config, backend, serving, deferred)
            await stop.wait()
        else:
            log.info("executor stopped while loading its model")
    finally:  # a load error too: the port is closed before it is reported
        await serving.server.stop(grace=2.0)
        if step_log is not None:
            step_log.close()
    log.info("executor stopped")


async def load_until_stopped(config: ExecutorConfig, stop: asyncio.Event,
                             converted: ConvertedWeights | None = None) -> Backend | None:
    """build_backend on a daemon thread (the event loop serves meanwhile); None if `stop` comes first. A load
    error is raised here."""
    loaded: Future[Backend] = Future()

    def load() -> None:
        try:
            loaded.set_result(build_backend(config, converted))
        except BaseException as exc:  # handed to the event loop's thread, which raises it
            loaded.set_exception(exc)

    threading.Thread(target=load, name="load", daemon=True).start()
    loading, stopping = asyncio.wrap_future(loaded), asyncio.ensure_future(stop.wait())
    await asyncio.wait((loading, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    return loading.result() if loading.done() else None


async def ready(config: ExecutorConfig, backend: Backend, serving: Serving,
                deferred: DeferredImports | None = None) -> None:
    """Report ready: the seconds since the process started in Describe and the log, then serve `backend`; a moment
    later run the `deferred` imports (on a low-priority thread), then freeze the heap."""
    started = process_start_time()
    info = backend.info = replace(backend.info, startup_seconds=round(max(0.0, time.time() - started), 3))
    if deferred is not None:  # before it answers: a test reads this line once the executor is healthy
        log.info("torch imports deferred until after ready: %s", ", ".join(deferred.pending_names()) or "none")
    await serving.attach(backend)
    limits = serving.servicer.limits
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in info.startup_phases) or "none"
    log.info("startup phases: %s; ready %.2f s after the process started", phases, info.startup_seconds)
    log.info("executor ready on %s (port %d): model=%s device=%s dtype=%s blocks=%d swap_blocks=%d; per step at "
             "most %d tokens, %d requests", config.listen, serving.port, info.model_id, info.device, info.dtype,
             info.num_device_blocks, info.num_swap_blocks, limits.max_num_batched_tokens, limits.max_num_seqs)
    gc.set_threshold(20_000, 50, 1000)
    loop = asyncio.get_running_loop()
    loop.call_later(FREEZE_HEAP_AFTER_S, finish_start, deferred, loop, serving.servicer.activity)
    if config.cpu_populate_kv:
        populate_in_background(backend, serving.servicer.activity)


def finish_start(deferred: DeferredImports | None, loop: asyncio.AbstractEventLoop,
                 activity: StepActivity | None = None) -> None:
    """After ready and its first answers: the deferred imports on their thread, then freeze_heap on the event loop
    (so the heap it freezes holds their objects too); with `activity`, each piece of that only while no step is in
    flight (it waits before each module their code imports: a step shares the GIL with one such piece at most)."""
    if deferred is None:
        freeze_heap()
        return
    pause = pause_for_steps(activity) if activity is not None else None
    run_in_background(deferred, lambda: call_soon_unless_closed(loop, freeze_heap), pause)


def pause_for_steps(activity: StepActivity, limit_s: float = QUIET_WAIT_LIMIT_S) -> Callable[[], object]:
    """Wait for a quiet moment (activity.py), unless another thread waits for a module whose import this thread holds
    (it would wait for us and we for it: go on); where the import system does not tell, wait at most MAX_PAUSE_S.
    Under load that never pauses, all the waits together end `limit_s` after the first, and the rest runs anyway
    (as it did before it waited: the heap is frozen in a busy executor too)."""
    per_pause = None if lock_holder_is_awaited() is not None else MAX_PAUSE_S
    give_up_at = time.monotonic() + limit_s

    def pause() -> bool:
        left = max(0.0, give_up_at - time.monotonic())
        return activity.wait_quiet(lambda: bool(lock_holder_is_awaited()), left if per_pause is None
                                   else min(left, per_pause))

    return pause


def populate_in_background(backend: Backend, activity: StepActivity | None = None) -> threading.Thread | None:
    """Where the backend holds a KV cache in CPU memory, fault its pages in on a daemon thread at the lowest CPU
    priority, a huge page at a time and (with `activity`) only while no step is in flight (for as long as it takes:
    in an executor never idle the steps fault the pages in as before): the steps that first write a block no longer
    wait for its page (kv_cache.populate). Not for tensor parallelism (its ranks' caches stay lazy)."""
    fault_in: Callable[[Callable[[], object]], int] | None = getattr(backend, "populate_kv_cache", None)
    if fault_in is None or backend.info.device != "cpu":
        return None
    pause = activity.wait_quiet if activity is not None else (lambda: None)
    log.info("KV cache: its pages are faulted in while the executor is idle")

    def run() -> None:
        lower_thread_priority()
        t0, done = time.perf_counter(), 0
        try:
            done = fault_in(pause)
        finally:  # the line benchmarks/vs_llamacpp.py waits for, also after a failure
            log.info("KV cache: %d MiB of pages faulted in after ready (%.2f s, pauses for steps included)",
                     done >> 20, time.perf_counter() - t0)

    thread = threading.Thread(target=run, name="kv-populate", daemon=True)
    thread.start()
    return thread


def call_soon_unless_closed(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> None:
    """callback on `loop` from another thread, or nothing once the loop is closed (the executor stopped while the
    deferred imports ran: it exits, waiting for the prefetch thread, without its event loop)."""
    with contextlib.suppress(RuntimeError):  # "Event loop is closed": no check first, it could close between
        loop.call_soon_threadsafe(callback)


def freeze_heap() -> None:
    """Collect the start's garbage, then move what is left out of the collector's sight (gc.freeze), so that
    collections while serving do not traverse the model's and the imports' objects. Run a moment after ready, not
    at it: the collection holds the event loop (0.05 - 0.1 s), which would delay the answer to the scheduler's held
    Describe and so the first token."""
    gc.collect()
    gc.freeze()


def run(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ExecutorConfig.from_args(argv)
    check_port_file(config.port_file)
    deferred = deferral_for(config)  # before anything imports torch
    converted = conversion_for(config)
    prefetch, cache = None, cache_for(config) if converted is not None else None
    if not config.simulated:  # the disk reads them (and widens bfloat16 ones, or maps them widened) while torch imports
        prefetch = prefetch_weights(config.model, converted, cache)
    set_omp_environment(omp_environment(config.cpu_omp_wait_policy, config.cpu_omp_spin_count))  # before torch loads
    try:
        if distributed(config):
            from executor_service.parallel.launch import launch
            return launch(config, lambda backend: uvloop.run(main(config, backend)))
        uvloop.run(main(config, converted=converted, deferred=deferred))
        finish_prefetch(prefetch, cache)
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers are installed (loading the model)
        log.info("executor interrupted while starting")
        return 130
    except Exception as e:  # start-up errors: one clear line, not a stack trace
        if type(e).__name__ not in ("ModelLoadError", "LaunchError"):
            raise
        log.error("%s", e)
        return 2
    return 0


def distributed(config: ExecutorConfig) -> bool:
    return config.tensor_parallel_size > 1 or config.nnodes > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1


def deferral_for(config: ExecutorConfig) -> DeferredImports | None:
    """Defer torch's imports that an eager forward does not use (deferred_imports.py), unless they are off
    (--no-lazy-torch-import, or PAGEDSERVE_LAZY_TORCH_IMPORT=0: config.apply_switches) or the process will need
    them (--compile-sizes traces with fake tensors) or is not a plain single-process one (simulated, tensor
    parallelism)."""
    if not config.lazy_torch_import:
        return None
    if config.simulated or config.compile_sizes or distributed(config):
        return None
    return defer_torch_imports()


def exit_quietly(code: int) -> None:
    """Exit without the interpreter's teardown: torch imports Triton when it is installed, and Triton's
    bindings print a page of 'nanobind: leaked ...' lines at teardown. Everything is flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_quietly(run())
