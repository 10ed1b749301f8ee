"""Start-up bookkeeping (#33): the phases of an executor's start with their timings, the seconds from the
process's start to ready, and the on-disk cache of what start-up measured (the packed GEMM's choice and the
skinny kernel's rows), keyed by everything the measurement depends on, so a restart on the same machine skips it.

A cache entry is trusted only when its whole key matches this start's: the CPU (model name and ISA flags), torch's
and oneDNN's versions, the kernels' build, the thread count, the requested settings and the model's linear shapes.
An entry that does not match (another machine's, an older build's) or does not parse is ignored, measured again
and overwritten: it is never trusted."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG, S_ISVTX
from typing import Any

log = logging.getLogger("pagedserve.executor")
CACHE_VERSION = 1
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"


def process_start_time() -> float:
    """The wall-clock time (time.time()) this process started: from /proc on Linux, else this module's import."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED


_IMPORTED = time.time()


@dataclass
class Phases:
    """Named phases of the start with their seconds, in order; total_s() is the time since the process started."""

    started: float = field(default_factory=process_start_time)
    seconds: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def total_s(self) -> float:
        return max(0.0, time.time() - self.started)

    def summary(self) -> str:
        parts = [f"{name} {s:.2f} s" for name, s in self.seconds.items()]
        return ", ".join(parts) if parts else "none"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "pagedserve"
    return base / "startup"


def cpu_identity() -> dict[str, str]:
    """What the CPU is, as start-up measurements depend on it: model name and ISA flags (Linux's /proc/cpuinfo)."""
    info = {"model name": "", "flags": ""}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in info and not info[key]:
                info[key] = " ".join(sorted(value.split())) if key == "flags" else value.strip()
            if all(info.values()):
                break
    import platform
    info["machine"] = platform.machine()
    return info


class MeasureCache:
    """JSON entries under `directory`, one file per kind of measurement holding the latest entry with the key it was
    measured under, and beside it up to MAX_KEYED_ENTRIES earlier entries of the kind by key (`kind.<digest>.json`,
    moved there when an entry for another key replaced them; each key's entry is in one file), so a
    machine that starts several models (or trees) in turn finds each one's measurement instead of measuring again
    whenever another was started in between. Under tensor parallelism each rank (`rank` of `world_size`) has its own
    files per kind, with its place in the group in the key: ranks measure on their own shards and cores, and sharing
    one file they overwrote each other's choice, so every start measured again."""

    def __init__(self, directory: Path | None, rank: int = 0, world_size: int = 1) -> None:
        self.directory, self.rank, self.world_size = directory, rank, world_size

    def path(self, kind: str, key: dict[str, Any] | None = None) -> Path | None:
        """The kind's latest entry; with `key`, the file of the entry kept for that key."""
        return self.file(kind, None if key is None else self.scoped(key))

    def file(self, kind: str, stored: dict[str, Any] | None) -> Path | None:
        """The kind's latest entry; with a key as stored (scoped), the file of the entry kept for it."""
        if self.directory is None:
            return None
        name = kind if self.world_size == 1 else f"{kind}.rank{self.rank}-of-{self.world_size}"
        suffix = "" if stored is None else f".{key_digest(stored)}"
        return self.directory / f"{name}{suffix}.json"

    def scoped(self, key: dict[str, Any]) -> dict[str, Any]:
        """The key as stored: a tensor-parallel rank's with its rank and the group's size (one rank's as it is)."""
        return key if self.world_size == 1 else {**key, "rank": self.rank, "world_size": self.world_size}

    def get(self, kind: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """The stored value for exactly this key (the latest entry, else the one kept for the key); None (and a log
        line saying why) where there is none to trust."""
        latest, keyed = self.path(kind), self.path(kind, key)
        if latest is None or keyed is None:
            return None
        value, why = self.read(latest, self.scoped(key))
        shown = latest
        if value is None and keyed.is_file():
            value, keyed_why = self.read(keyed, self.scoped(key))
            if value is not None or keyed_why:
                why, shown = keyed_why, keyed
        if why:
            log.info("start-up cache %s %s; measuring again", shown, why)
        return value

    @staticmethod
    def read(path: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """The value of the entry at `path` if it is there, trusted, intact and for `key`; else None and why not ("":
        there is no entry)."""
        if not path.is_file():
            return None, ""
        distrust = untrusted(path)
        if distrust:
            return None, f"not used ({distrust})"
        try:
            entry = read_entry(path)
            stored, value, digest = entry["key"], entry["value"], entry["digest"]
        except (OSError, ValueError, KeyError, TypeError):
            return None, "unreadable"
        if digest != fingerprint(stored, value) or not isinstance(value, dict) or not isinstance(stored, dict):
            return None, "corrupt"
        if stored != key:
            changed = sorted(k for k in set(stored) | set(key) if stored.get(k) != key.get(k))
            return None, f"is stale or foreign ({', '.join(changed)} differ)"
        return value, ""

    def put(self, kind: str, key: dict[str, Any], value: dict[str, Any]) -> str:
        """Keep `value` under `key` for the next start as the kind's latest entry, the latest one before it (for
        another key) moved aside to that key's file and the oldest of those past MAX_KEYED_ENTRIES dropped: "" where
        it is kept, else why not (the cache is off, or the write failed: a read-only home still starts, it just
        measures every time)."""
        latest, keyed = self.path(kind), self.path(kind, key)
        if latest is None or keyed is None:
            return "the start-up cache is off"
        key = self.scoped(key)
        data = json.dumps({"key": key, "value": value, "digest": fingerprint(key, value)}, sort_keys=True)
        try:
            latest.parent.mkdir(parents=True, exist_ok=True)
            self.keep_aside(kind, latest, key)
            write_atomically(latest, kind, data)
        except OSError as exc:
            return f"start-up cache {latest} not written: {exc.strerror or exc}"
        with contextlib.suppress(OSError):
            keyed.unlink(missing_ok=True)  # one file per key: the latest now
        keyed_name = re.compile(rf"{re.escape(latest.stem)}\.[0-9a-f]{{{KEY_DIGEST_CHARS}}}\.json")
        drop_oldest([p for p in latest.parent.iterdir() if keyed_name.fullmatch(p.name)], MAX_KEYED_ENTRIES)
        return ""

    def keep_aside(self, kind: str, latest: Path, key: dict[str, Any]) -> None:
        """Move the kind's latest entry, if it is a trusted one for another key, to that key's file."""
        if not latest.is_file() or untrusted(latest):
            return
        try:
            stored = read_entry(latest)["key"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        aside = self.file(kind, stored) if isinstance(stored, dict) and stored != key else None
        if aside is not None:
            os.replace(latest, aside)


MAX_KEYED_ENTRIES = 8
KEY_DIGEST_CHARS = 16


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:KEY_DIGEST_CHARS]


def write_atomically(path: Path, kind: str, data: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{kind}-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(data)
    os.replace(tmp, path)


def drop_oldest(paths: list[Path], keep: int) -> None:
    """Remove all but the `keep` most recently written of `paths` (a file that is gone already is skipped)."""
    def written(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:
            return 0.0

    for path in sorted(paths, key=written, reverse=True)[keep:]:
        with contextlib.suppress(OSError):
            path.unlink()


def untrusted(path: Path) -> str:
    """Why a cache file may have been written by someone else ("": it cannot): it must be a regular file (not a
    link) of this process's user or root (an image's prebuilt entries) that not every user may write, in a
    directory of this user or root that not every user may write (unless sticky, as /tmp: there nobody else can
    replace our files). An entry's key is computed from what anyone may read (the checkpoint's stat and header,
    the CPU), so in a shared directory another user could plant an entry that matches, and with it the weights this
    executor serves. (Group write is left to the operator: a umask of 002 gives every directory it.)"""
    try:
        stat = os.lstat(path)
        parent = os.stat(path.parent)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    me = os.geteuid()
    if not S_ISREG(stat.st_mode) or stat.st_uid not in (me, 0) or stat.st_mode & 0o002:
        return "not a regular file of this user (or root) that not every user may write"
    if parent.st_uid not in (me, 0) or (parent.st_mode & 0o002 and not parent.st_mode & S_ISVTX):
        return "its directory may be written by other users"
    return ""


MAX_ENTRY_BYTES = 1 << 20
"""A cache's `.json` entry is a few hundred bytes; one larger is not ours, and is not read whole."""


def read_entry(path: Path) -> dict[str, Any]:
    """A cache entry's JSON object, trusting nothing about the file: ValueError where it is larger than
    MAX_ENTRY_BYTES, nested too deeply for the parser (RecursionError crashed the start) or not an object, OSError
    where it cannot be read."""
    with open(path, "rb") as f:
        data = f.read(MAX_ENTRY_BYTES + 1)
    if len(data) > MAX_ENTRY_BYTES:
        raise ValueError(f"larger than {MAX_ENTRY_BYTES} bytes")
    try:
        entry = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if not isinstance(entry, dict):
        raise ValueError("not a JSON object")
    return entry


def fingerprint(key: Any, value: Any) -> str:
    return hashlib.sha256(json.dumps([key, value], sort_keys=True).encode()).hexdigest()
