"""The float32 form of a bfloat16 checkpoint kept on disk (#33), so that a restart maps it instead of widening again.

A warm start of a bfloat16 checkpoint used to widen its 494 M weights (0.5B) on the prefetch thread while torch
imported (converted.py): about 1 s of one core and 2 GB of fresh memory, on two cores where the import wanted both.
Here each weight file's arena (converted.py's layout: 64-byte aligned, fused q/k/v and gate/up parts one after
another) is written once, after the conversion, to `<cache>/<digest of the file's path>.f32` with a `.json` beside
it; the next start maps that file copy-on-write (its pages the page cache's, as a float32 checkpoint's are) and the
parameters are views of it. The disk cost is twice the bfloat16 files' size per model.

The `.json` holds the key: the source file's path, size, mtime, ctime, inode and header digest, the CPU (model,
ISA flags, machine), the byte order and this format's version, and the data file's size, mtime and a digest of sampled
pages. A cache is used only when all of it matches and the arena size the header implies equals the data file's:
a stale (the checkpoint changed), foreign (another machine's or format's), truncated or replaced one is ignored,
converted again and rewritten, never trusted. The data file is complete and synced before its `.json` is written.
Imports nothing heavy (numpy through converted.py)."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from executor_service.converted import MAX_HEADER_BYTES, ConvertedFile, convertible_entries, plan_arena
from executor_service.startup import cpu_identity, read_entry, untrusted

log = logging.getLogger("pagedserve.executor")
FORMAT_VERSION = 1
SAMPLE_BYTES = 4096
SAMPLE_STRIDE = 64 << 20
FREE_DISK_MARGIN = 1 << 30
"""A cache file is written only where the disk keeps this much free beside it."""
WRITE_CHUNK = 64 << 20
MADV_POPULATE_READ = 22  # linux/mman.h
MIN_RESIDENT_SHARE = 0.9
PAGE = mmap.PAGESIZE


@dataclass(frozen=True, slots=True)
class Loaded:
    """What the cache had for a file: its converted form (None where not used) and whether a valid entry exists."""

    converted: ConvertedFile | None
    valid: bool


@dataclass(frozen=True, slots=True)
class Source:
    """A safetensors file as the cache knows it: its path, header (parsed and raw) and where its data starts."""

    path: Path
    header: dict[str, Any]
    raw_header: bytes
    data_start: int
    size: int


class ConvertedCache:
    """The converted files under `directory`: load() a file's arena where a valid one is there, store() one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.writing = threading.Event()
        """Set once a store() has begun: the process then lets it finish before it exits (prefetch.finish_prefetch)."""

    def paths(self, source: Path) -> tuple[Path, Path]:
        stem = hashlib.sha256(os.path.realpath(source).encode()).hexdigest()[:24]
        return self.directory / f"{stem}.f32", self.directory / f"{stem}.json"

    def load(self, source: Source) -> Loaded:
        """The file's float32 arena mapped from the cache (copy-on-write) where a valid one is there and in the page
        cache; a valid one on disk only is left there (reading 2x the bytes from the disk is slower than reading
        the checkpoint and converting it). Logs why an entry is not used."""
        data, meta = self.paths(source.path)
        entries = convertible_entries(source.header, source.data_start, source.size)
        if not entries or not meta.is_file():
            return Loaded(None, valid=False)
        placed, spans, size = plan_arena(entries)
        entry, reason = None, untrusted(meta)
        if not reason:
            entry, reason = self.read_meta(meta, source)
        if entry is not None:
            reason = self.check_data(data, size, entry) or untrusted(data)
        if reason:
            log.info("converted-weights cache for %s not used (%s); converting again", source.path.name, reason)
            return Loaded(None, valid=False)
        with open(data, "rb") as f:
            arena = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if resident_share(arena) < MIN_RESIDENT_SHARE:
            arena.close()
            log.info("converted-weights cache for %s is not in the page cache; converting the checkpoint instead",
                     source.path.name)
            return Loaded(None, valid=True)
        populate(arena)
        return Loaded(ConvertedFile(arena, placed, spans, size), valid=True)

    def read_meta(self, meta: Path, source: Source) -> tuple[dict[str, Any] | None, str]:
        """The `.json`'s entry where it can be trusted for this source, else None and why."""
        try:
            entry = read_entry(meta)
            stored, digest = entry["key"], entry["digest"]
        except (OSError, ValueError, KeyError, TypeError):
            return None, "unreadable"
        if not isinstance(stored, dict) or digest != digest_of(stored, entry.get("data")):
            return None, "corrupt"
        key = source_key(source)
        if stored != key:
            changed = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
            return None, f"stale or foreign: {', '.join(changed)} differ"
        return entry, ""

    def check_data(self, data: Path, size: int, entry: dict[str, Any]) -> str:
        """Why the data file cannot be trusted ("": it can): missing, truncated, replaced or its pages changed."""
        recorded = entry.get("data")
        try:
            stat = data.stat()
        except OSError:
            return "data file missing"
        if not isinstance(recorded, dict) or recorded.get("size") != size or stat.st_size != size:
            return f"truncated or of another layout ({stat.st_size} bytes, {size} expected)"
        if recorded.get("mtime_ns") != stat.st_mtime_ns:
            return "data file replaced since it was written"
        with open(data, "rb") as f:
            if sampled_digest(f.fileno(), size) != recorded.get("sampled"):
                return "data file's contents changed"
        return ""

    def store(self, source: Source, converted: ConvertedFile, size: int) -> None:
        """Write the arena's first `size` bytes and then its `.json` (temporary names, synced, renamed); a full disk or
        a read-only directory leaves no cache (logged)."""
        data, meta = self.paths(source.path)
        self.writing.set()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.directory, data.stem)
            if free_bytes(self.directory) < size + FREE_DISK_MARGIN:
                log.info("converted-weights cache for %s not written: the disk is nearly full", source.path.name)
                return
            tmp = temporary(data)
            write_synced(tmp, memoryview(converted.arena)[:size])
            os.replace(tmp, data)
            stat = data.stat()
            with open(data, "rb") as f:
                recorded = {"size": size, "mtime_ns": stat.st_mtime_ns, "sampled": sampled_digest(f.fileno(), size)}
            key = source_key(source)
            text = json.dumps({"key": key, "data": recorded, "digest": digest_of(key, recorded)}, sort_keys=True)
            tmp_meta = temporary(meta)
            tmp_meta.write_text(text, encoding="utf-8")
            os.replace(tmp_meta, meta)
        except OSError as exc:
            log.info("converted-weights cache for %s not written: %s", source.path.name, exc)


def read_source(f: BinaryIO, path: Path, size: int) -> Source | None:
    """The safetensors file's header (parsed and raw) and where its data starts; None where it is not one."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(size - 8, MAX_HEADER_BYTES):
        return None
    raw = f.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    return Source(path, header, raw, 8 + length, size) if isinstance(header, dict) else None


def source_key(source: Source) -> dict[str, Any]:
    """Everything the converted form depends on: the file (path, size, mtime, ctime, inode, header), the CPU and the
    format. ctime cannot be set back by hand, so a file written over in place with its mtime restored shows too."""
    stat = source.path.stat()
    return {
        "version": FORMAT_VERSION,
        "path": os.path.realpath(source.path),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
        "inode": stat.st_ino,
        "header": hashlib.sha256(source.raw_header).hexdigest(),
        "cpu": cpu_identity(),
        "byteorder": sys.byteorder,
    }


def digest_of(key: Any, data: Any) -> str:
    return hashlib.sha256(json.dumps([key, data], sort_keys=True).encode()).hexdigest()


def sampled_digest(fd: int, size: int) -> str:
    """SHA-256 of SAMPLE_BYTES every SAMPLE_STRIDE and of the last SAMPLE_BYTES: a replaced or zeroed file shows in
    it at the cost of a few pages."""
    digest = hashlib.sha256()
    offsets = [*range(0, size, SAMPLE_STRIDE), max(0, size - SAMPLE_BYTES)]
    for offset in offsets:
        digest.update(os.pread(fd, SAMPLE_BYTES, offset))
    return digest.hexdigest()


def write_synced(path: Path, data: memoryview) -> None:
    """Write `data` to a new file in chunks (os.write lets go of the GIL) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for start in range(0, len(data), WRITE_CHUNK):
            chunk = data[start : start + WRITE_CHUNK]
            while chunk:
                chunk = chunk[os.write(fd, chunk):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise
    os.close(fd)


def temporary(final: Path) -> Path:
    """A new empty file beside `final` to write it under: `.<stem>.<pid>.<random>.tmp` (two executors sharing the
    directory, even with one pid in two containers, never write the same one)."""
    fd, name = tempfile.mkstemp(prefix=f".{final.stem}.{os.getpid()}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(name)


def remove_leftovers(directory: Path, stem: str) -> None:
    """Temporary files of this entry that no live process is writing (an executor stopped while writing)."""
    for tmp in directory.glob(f".{stem}.*.tmp"):
        pid = tmp.name.split(".")[2] if tmp.name.count(".") >= 4 else ""
        if pid.isdigit() and not process_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_bytes(directory: Path) -> int:
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def resident_share(buffer: mmap.mmap) -> float:
    """The share of the map's pages in the page cache (mincore); 1.0 where it cannot be told."""
    pages = -(-len(buffer) // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    start = ctypes.c_char.from_buffer(buffer)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mincore(ctypes.byref(start), ctypes.c_size_t(len(buffer)), vector) != 0:
            return 1.0
    except (OSError, AttributeError):
        return 1.0
    finally:
        del start  # the map cannot close while a ctypes object holds its buffer
    return int(np.count_nonzero(np.frombuffer(bytes(vector), dtype=np.uint8) & 1)) / pages


def populate(buffer: mmap.mmap) -> None:
    """Fault the whole map in with one call (read faults: the pages stay the page cache's)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        buffer.madvise(MADV_POPULATE_READ)
