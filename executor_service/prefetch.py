"""Reading the weights while the interpreter imports torch (#33): the first thing an executor does is start a thread
that maps the model's safetensors files and populates the maps (MADV_POPULATE_READ, called through ctypes, which
lets go of the GIL while the kernel reads: the imports go on), then drops them, so that the files are in the page
cache by the time the loader maps them. posix_fadvise(WILLNEED) would not do: Linux reads only the readahead
window (128 KiB by default) of each file for it. Given a ConvertedWeights, the same thread also widens each file's
bfloat16 tensors to float32 (converted.py) while the imports hold the other core. Imports nothing heavy (numpy
only where it converts)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from executor_service.placement import lower_thread_priority

if TYPE_CHECKING:
    from executor_service.config import ExecutorConfig
    from executor_service.converted import ConvertedFile, ConvertedWeights
    from executor_service.converted_cache import ConvertedCache, Source

log = logging.getLogger("pagedserve.executor")
MEMINFO = Path("/proc/meminfo")
MAX_SHARE_OF_AVAILABLE = 0.5
"""Files larger than this share of the available memory are left alone: read ahead, they would push each other out."""
MADV_POPULATE_READ = 22  # linux/mman.h (Linux 5.14+)
READ_CHUNK = 16 << 20
NVIDIA_DRIVER = Path("/proc/driver/nvidia")
FINISH_TIMEOUT_S = 60.0


def prefetch_weights(model_dir: str | None, converted: ConvertedWeights | None = None,
                     cache: ConvertedCache | None = None) -> threading.Thread | None:
    """Start reading model_dir's *.safetensors into the page cache on a daemon thread (and converting them into
    `converted`, where given and the memory allows: mapped from `cache` where it holds them, else converted and
    written there afterwards); None where there is nothing to do (no such directory, not Linux, or the files are
    too large for the memory available)."""
    if not model_dir or not hasattr(os, "sched_getaffinity"):
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError:
        return None
    available = available_bytes()
    if total == 0 or total > MAX_SHARE_OF_AVAILABLE * available:
        return None
    if converted is not None and 3 * total > MAX_SHARE_OF_AVAILABLE * available:  # the files and 2x them in float32
        converted = None
    if converted is not None:
        converted.expect(files)
    thread = threading.Thread(target=read_files, args=(files, converted, cache), name="prefetch", daemon=True)
    thread.start()
    log.info("reading %d weight files (%.2f GB) into the page cache%s while the executor starts", len(files),
             total / 1e9, " and converting them to float32" if converted is not None else "")
    return thread


def conversion_for(config: ExecutorConfig) -> ConvertedWeights | None:
    """A ConvertedWeights where the executor will compute in float32 on the CPU in one process (a bfloat16 checkpoint
    is then widened while torch imports); None elsewhere. A CUDA machine is recognised by its driver's /proc
    entry, since torch is not imported yet: on one with --device auto nothing is converted."""
    one_process = config.tensor_parallel_size == 1 and config.nnodes == 1 and os.environ.get("WORLD_SIZE", "1") == "1"
    on_cpu = config.device == "cpu" or (config.device == "auto" and not NVIDIA_DRIVER.exists())
    if config.simulated or not one_process or not on_cpu or config.dtype not in ("auto", "float32"):
        return None
    from executor_service.converted import ConvertedWeights
    return ConvertedWeights()


def cache_for(config: ExecutorConfig) -> ConvertedCache | None:
    """Where a converted checkpoint is kept between starts: `converted/` in the start-up cache's directory; None where
    --no-converted-weights-cache (or PAGEDSERVE_CONVERTED_CACHE=0, config.apply_switches) or --startup-cache-dir ''
    turn it off."""
    if not config.converted_weights_cache or config.startup_cache_dir == "":
        return None
    from executor_service.converted_cache import ConvertedCache
    from executor_service.startup import default_cache_dir
    base = Path(config.startup_cache_dir) if config.startup_cache_dir else default_cache_dir()
    return ConvertedCache(base / "converted")


def finish_prefetch(thread: threading.Thread | None, cache: ConvertedCache | None,
                    timeout_s: float = FINISH_TIMEOUT_S) -> None:
    """Let the prefetch thread finish writing the converted-weights cache before the process exits (at most
    timeout_s): the next start would convert again otherwise. A thread still reading or converting (stopped while
    loading) is not waited for."""
    if thread is not None and cache is not None and cache.writing.is_set() and thread.is_alive():
        log.info("finishing the converted-weights cache before exiting (at most %.0f s)", timeout_s)
        thread.join(timeout_s)


def read_files(files: list[Path], converted: ConvertedWeights | None = None,
               cache: ConvertedCache | None = None) -> int:
    """Read (or convert) the files, then write what was converted to `cache`; the files mapped from the cache."""
    t0 = time.perf_counter()
    to_store: list[tuple[Source, ConvertedFile]] = []
    mapped = 0
    try:
        with contextlib.suppress(OSError, ValueError, BufferError):
            libc = ctypes.CDLL(None, use_errno=True)
            for path in files:
                if converted is not None:
                    mapped += widen_file(libc, path, converted, cache, to_store)
                elif not populate_file(libc, path):
                    read_file(path)
            done = f" and converted ({mapped} of {len(files)} mapped from the cache)" if converted is not None else ""
            log.info("weight files in the page cache%s %.2f s after the prefetch started", done,
                     time.perf_counter() - t0)
    finally:
        if converted is not None:
            converted.abandon()
    store_converted(cache, to_store)
    return mapped


def widen_file(libc: ctypes.CDLL, path: Path, converted: ConvertedWeights, cache: ConvertedCache | None,
               to_store: list[tuple[Source, ConvertedFile]]) -> bool:
    """Widen the file's bfloat16 tensors into `converted`: mapped from `cache` where it holds them (True), else
    converted from the file (mapped and faulted in) and noted in `to_store`; a failure leaves the file to the loader
    (logged)."""
    from executor_service.converted import convert_file
    from executor_service.converted_cache import read_source
    result = cached = None
    try:
        with open(path, "rb") as f:
            source = read_source(f, path, os.fstat(f.fileno()).st_size)
            cached = cache.load(source) if cache is not None and source is not None else None
            result = cached.converted if cached is not None else None
            if source is not None and result is None:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buffer:
                    populate(libc, buffer)
                    result = convert_file(buffer, source.header, source.data_start)
                if result is not None and cache is not None and not (cached is not None and cached.valid):
                    to_store.append((source, result))
    except (OSError, ValueError, BufferError, MemoryError) as exc:
        log.info("%s not converted while importing (the loader converts it): %s", path.name, exc)
    converted.put(path, result)
    return result is not None and cached is not None and cached.converted is result


def store_converted(cache: ConvertedCache | None, to_store: list[tuple[Source, ConvertedFile]]) -> None:
    """Write what was converted to the cache for the next start (after every file is handed to the loader), at the
    lowest priority: on a cold start it copies 2x the checkpoint's bytes while the loader and the packing run."""
    if cache is None or not to_store:
        return
    lower_thread_priority()  # behind the loading and the packing: the next start's gain
    t0 = time.perf_counter()
    for source, result in to_store:
        cache.store(source, result, result.size)
    log.info("converted weights written to %s in %.2f s", cache.directory, time.perf_counter() - t0)


def populate_file(libc: ctypes.CDLL, path: Path) -> bool:
    """Map the file and fault it all in with one madvise call (the GIL released); False where the kernel cannot."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return True
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buffer:
            return populate(libc, buffer)


def populate(libc: ctypes.CDLL, buffer: mmap.mmap) -> bool:
    start = ctypes.c_char.from_buffer(buffer)
    try:
        return bool(libc.madvise(ctypes.byref(start), ctypes.c_size_t(len(buffer)), MADV_POPULATE_READ) == 0)
    finally:
        del start  # the map cannot close while a ctypes object holds its buffer


def read_file(path: Path) -> None:
    """Read the file through (readinto lets go of the GIL), for kernels without MADV_POPULATE_READ."""
    chunk = bytearray(READ_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(chunk):
            pass


def available_bytes() -> int:
    """MemAvailable from /proc/meminfo; 0 where it cannot be read (then nothing is prefetched)."""
    with contextlib.suppress(OSError, ValueError):
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
