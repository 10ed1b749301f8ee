"""Reading the weights while the interpreter imports torch (#33): the first thing an executor does is start a thread
that maps the model's safetensors files and populates the maps (MADV_POPULATE_READ, called through ctypes, which
lets go of the GIL while the kernel reads: the imports go on), then drops them, so that the files are in the page
cache by the time the loader maps them. posix_fadvise(WILLNEED) would not do: Linux reads only the readahead
window (128 KiB by default) of each file for it. Imports nothing heavy."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("pagedserve.executor")
MEMINFO = Path("/proc/meminfo")
MAX_SHARE_OF_AVAILABLE = 0.5
"""Files larger than this share of the available memory are left alone: read ahead, they would push each other out."""
MADV_POPULATE_READ = 22  # linux/mman.h (Linux 5.14+)
READ_CHUNK = 16 << 20


def prefetch_weights(model_dir: str | None) -> threading.Thread | None:
    """Start reading model_dir's *.safetensors into the page cache on a daemon thread; None where there is
    nothing to do (no such directory, not Linux, or the files are too large for the memory available)."""
    if not model_dir or not hasattr(os, "sched_getaffinity"):
        return None
    files = sorted(Path(model_dir).glob("*.safetensors"))
    try:
        total = sum(f.stat().st_size for f in files)
    except OSError:
        return None
    if total == 0 or total > MAX_SHARE_OF_AVAILABLE * available_bytes():
        return None
    thread = threading.Thread(target=read_files, args=(files,), name="prefetch", daemon=True)
    thread.start()
    log.info("reading %d weight files (%.2f GB) into the page cache while the executor starts", len(files),
             total / 1e9)
    return thread


def read_files(files: list[Path]) -> None:
    t0 = time.perf_counter()
    with contextlib.suppress(OSError, ValueError, BufferError):
        libc = ctypes.CDLL(None, use_errno=True)
        for path in files:
            if not populate_file(libc, path):
                read_file(path)
        log.info("weight files in the page cache %.2f s after the prefetch started", time.perf_counter() - t0)


def populate_file(libc: ctypes.CDLL, path: Path) -> bool:
    """Map the file and fault it all in with one madvise call (the GIL released); False where the kernel cannot."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return True
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buffer:
            start = ctypes.c_char.from_buffer(buffer)
            try:
                done = libc.madvise(ctypes.byref(start), ctypes.c_size_t(len(buffer)), MADV_POPULATE_READ) == 0
            finally:
                del start  # the map cannot close while a ctypes object holds its buffer
    return bool(done)


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
