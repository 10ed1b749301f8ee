"""A bfloat16 checkpoint converted to float32 while torch imports (#33).

The CPU executor computes in float32, so each 16-bit weight has to be widened once at start-up: 494 M of them at
0.5B, about 1 s of one core plus the page faults of 2 GB of fresh memory. torch's import holds the interpreter's
first core for 2 - 3 s meanwhile, so the prefetch thread (prefetch.py) does the widening there, with numpy, whose
loops let go of the GIL: bfloat16 is the top half of a float32, so the conversion is a 16-bit left shift into
uint32 (bit-equal to torch's `.to(torch.float32)`, NaNs included). float16 is left to the loader: numpy's cast
quiets signalling NaNs that torch's keeps, so the two would differ in 1,022 of the 65,536 patterns.

Each file's float32 tensors lie in one anonymous memory map (its arena), 64-byte aligned, the parts of a fused
parameter (q, k, v; gate, up) one after another in part order, so the loader makes the model's parameters views
of the arena without another copy (model/loader.py). Imports nothing heavy (numpy only)."""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from executor_service.checkpoint_names import fused_part, parts_of, standard_name

ALIGNMENT = 64
ITEM_BYTES = {"BF16": 2}
"""The checkpoint dtypes converted (to float32: 4 bytes an element)."""
MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a safetensors file: its dtype's name, shape and [begin, end) bytes in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a converted tensor lies in its file's arena: its first byte and its shape (float32)."""

    offset: int
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Span:
    """A fused parameter's converted parts placed one after another: its first byte, shape and each part's rows."""

    offset: int
    shape: tuple[int, ...]
    rows: tuple[int, ...]


@dataclass(slots=True)
class ConvertedFile:
    """A file's converted tensors: the arena (an anonymous map) and where each tensor and fused span lies in it."""

    arena: mmap.mmap
    tensors: dict[str, Placed] = field(default_factory=dict)
    spans: dict[str, Span] = field(default_factory=dict)
    size: int = 0
    """The arena's bytes in use (plan_arena's size; the map may be larger)."""


class ConvertedWeights:
    """The files converted on the prefetch thread, one future each: take() waits for a file's conversion and hands
    it over (forgotten here: its arena lives as long as the tensors that view it), None for a file that was not
    converted (not expected, nothing to convert in it, its conversion failed, or taken already)."""

    def __init__(self) -> None:
        self._files: dict[str, Future[ConvertedFile | None]] = {}

    def expect(self, paths: Iterable[Path]) -> None:
        for path in paths:
            self._files[key_of(path)] = Future()

    def put(self, path: Path, converted: ConvertedFile | None) -> None:
        future = self._files.get(key_of(path))
        if future is not None and not future.done():
            future.set_result(converted)

    def abandon(self) -> None:
        """Every file not converted yet will not be (the prefetch thread is ending)."""
        for future in list(self._files.values()):  # a copy: the loader's take() forgets files meanwhile
            if not future.done():
                future.set_result(None)

    def take(self, path: Path) -> ConvertedFile | None:
        """Wait for the file's conversion, then forget it (only then: put() and abandon() find it until it is done)."""
        key = key_of(path)
        future = self._files.get(key)
        if future is None:
            return None
        converted = future.result()
        self._files.pop(key, None)
        return converted


def key_of(path: Path) -> str:
    return os.path.realpath(path)


def read_header(f: BinaryIO, size: int) -> tuple[dict[str, Any], int] | None:
    """A safetensors file's JSON header and the offset its data starts at; None where it is not one."""
    if size < 8:
        return None
    (length,) = struct.unpack("<Q", f.read(8))
    if length > min(size - 8, MAX_HEADER_BYTES):
        return None
    try:
        header = json.loads(f.read(length))
    except ValueError:
        return None
    return (header, 8 + length) if isinstance(header, dict) else None


def convertible_entries(header: dict[str, Any], data_start: int, size: int) -> list[Entry]:
    """The header's well-formed bfloat16 tensors (others are left to the loader, which checks them)."""
    entries = []
    for name, entry in header.items():
        if not isinstance(entry, dict) or entry.get("dtype") not in ITEM_BYTES:
            continue
        try:
            begin, end = (data_start + int(x) for x in entry["data_offsets"])
            shape = tuple(int(d) for d in entry["shape"])
        except (KeyError, TypeError, ValueError):
            continue
        if min(shape, default=0) >= 0 and data_start <= begin <= end <= size \
                and end - begin == math.prod(shape) * ITEM_BYTES[entry["dtype"]]:
            entries.append(Entry(name, entry["dtype"], shape, begin, end))
    return sorted(entries, key=lambda e: e.begin)


def plan_arena(entries: list[Entry]) -> tuple[dict[str, Placed], dict[str, Span], int]:
    """Where each entry goes in the arena (64-byte aligned; a fused parameter's parts one after another where the
    file holds them all, of one dtype and row width), the spans of the fused parameters, and the arena's bytes."""
    groups: dict[str, dict[int, Entry]] = {}
    for entry in entries:
        fused = fused_part(standard_name(entry.name))
        if fused is not None:
            groups.setdefault(fused[0], {})[fused[1]] = entry
    placed: dict[str, Placed] = {}
    spans: dict[str, Span] = {}
    offset = 0
    for param, parts in groups.items():
        if is_whole_group(param, parts):
            ordered = [parts[i] for i in range(len(parts))]
            rows = tuple(e.shape[0] for e in ordered)
            spans[param] = Span(offset, (sum(rows), *ordered[0].shape[1:]), rows)
            for e in ordered:
                placed[e.name] = Placed(offset, e.shape)
                offset += math.prod(e.shape) * 4
            offset = aligned(offset)
    for entry in entries:
        if entry.name not in placed:
            placed[entry.name] = Placed(offset, entry.shape)
            offset = aligned(offset + math.prod(entry.shape) * 4)
    return placed, spans, offset


def is_whole_group(param: str, parts: dict[int, Entry]) -> bool:
    first = parts.get(0)
    return (first is not None and len(parts) == parts_of(param) and set(parts) == set(range(len(parts)))
            and len(first.shape) >= 1
            and all(e.dtype == first.dtype and e.shape[1:] == first.shape[1:] for e in parts.values()))


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def convert_file(buffer: mmap.mmap, header: dict[str, Any], data_start: int) -> ConvertedFile | None:
    """The file's (mapped in `buffer`) bfloat16 tensors in float32 in a new arena; None where it has none."""
    entries = convertible_entries(header, data_start, len(buffer))
    if not entries:
        return None
    placed, spans, size = plan_arena(entries)
    arena = mmap.mmap(-1, max(size, ALIGNMENT), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for entry in entries:
        convert_entry(buffer, entry, arena, placed[entry.name].offset)
    return ConvertedFile(arena, placed, spans, size)


def convert_entry(buffer: mmap.mmap, entry: Entry, arena: mmap.mmap, offset: int) -> None:
    """Widen one tensor into the arena at `offset` (numpy's loops run without the GIL)."""
    count = math.prod(entry.shape)
    if count == 0:
        return
    source = np.frombuffer(buffer, dtype="<u2", count=count, offset=entry.begin)
    np.left_shift(source, 16, out=np.frombuffer(arena, dtype=np.uint32, count=count, offset=offset), dtype=np.uint32)
