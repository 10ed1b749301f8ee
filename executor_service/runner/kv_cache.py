"""Paged KV cache on the device plus a CPU swap area.

Device storage is one tensor, [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim], so a copy
of any set of blocks is one index_select + one index_copy_ over all layers. With KV cache groups (kv_groups.py)
num_layers is a group's size and each model layer reads its page slot of the blocks. On a CPU the swap area has
the same layout. Under CUDA it is pinned host memory laid out block first, [num_blocks, num_layers, 2, ...], so
that each swap block is one contiguous range: the GPU gathers the blocks into that order and the copy engine
moves each run of consecutive swap blocks in one DMA, with no gather or scatter by the host's cores. CUDA swaps
run on a side stream ordered against the compute stream with wait_stream / events.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from executor_service.prefetch import available_bytes
from protos.contract import BlockMap

log = logging.getLogger("pagedserve.executor")

GIB = 1 << 30
LAZY_MIN_BYTES = 1 << 20
HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14 (not in Python 3.11's mmap module)


@dataclass(slots=True, frozen=True)
class CacheShape:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def blocks_in(self, gib: float) -> int:
        return int(gib * GIB) // self.bytes_per_block

    def dims(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def block_first_dims(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


def lazy_zeros(dims: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> Tensor:
    """A zero CPU tensor whose pages the OS supplies (zeroed) on first touch: an anonymous private map, so a
    cache of gigabytes costs nothing at start-up and only the blocks in use take memory. Small ones (under
    LAZY_MIN_BYTES) are plain torch.zeros. With `huge_pages` the map starts on a 2 MiB boundary and asks for
    transparent huge pages (MADV_HUGEPAGE): memory is then taken 2 MiB at a time (a layer's 128 blocks of the
    benchmark model), and a decode step's reads of blocks scattered over the cache miss the TLB far less (paged
    attention 1.0 - 1.16x on an AMD Zen 3: BENCHMARKS.md section 17, twelfth session)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(dims) * itemsize
    if nbytes < LAZY_MIN_BYTES:
        return torch.zeros(dims, dtype=dtype)
    huge = huge_pages and hasattr(mmap, "MADV_HUGEPAGE")
    buffer = mmap.mmap(-1, nbytes + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    offset = -address_of(buffer) % HUGE_PAGE if huge and advise_huge(buffer) else 0
    flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset)
    return flat.view(dtype).view(dims)  # the tensor holds the map


def advise_huge(buffer: mmap.mmap) -> bool:
    """Ask for transparent huge pages on the map; False (with a warning) where the kernel refuses, as one built
    without THP does (EINVAL): the map then stays in 4 KiB pages and the executor starts all the same."""
    try:
        buffer.madvise(mmap.MADV_HUGEPAGE)
    except OSError as error:
        log.warning("no transparent huge pages for a KV cache map (%s): it stays in 4 KiB pages", error)
        return False
    return True


def populate(cache: Tensor, pause: Callable[[], object] = lambda: None, chunk: int = HUGE_PAGE) -> int:
    """Fault in the pages of a contiguous CPU tensor (a lazy_zeros map) now: MADV_POPULATE_WRITE, writable and
    zero where untouched, what is written kept; `chunk` bytes at a time with pause() before each, instead of in
    the steps that first write each block (a huge page's first write costs 1 - 6 ms of compaction and zeroing, and
    a step of fresh blocks waited for it, #29). A chunk holds the process's address-space lock (mmap_lock) for its
    length, so chunks are one huge page: an allocation that maps memory meanwhile waits ~3 ms at most, not the
    ~45 ms of a 16 MiB chunk. Skipped where the machine has not the memory for it (fits_in_memory). Returns the
    bytes populated: fewer where the kernel cannot (before Linux 5.14: EINVAL; ENOMEM), logged once."""
    if not cache.is_contiguous() or cache.device.type != "cpu":
        raise ValueError("populate takes a contiguous CPU tensor")
    size = cache.numel() * cache.element_size()
    if size == 0 or not fits_in_memory(size):
        return 0
    first = cache.data_ptr()
    madvise = ctypes.CDLL(None, use_errno=True).madvise  # ctypes drops the GIL for the call
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for at in range(first // mmap.PAGESIZE * mmap.PAGESIZE, first + size, chunk):
        pause()
        end = min(at + chunk, first + size)
        if madvise(at, end - at, MADV_POPULATE_WRITE) != 0:
            code = ctypes.get_errno()
            log.warning("the KV cache's pages are faulted in as steps first write them (madvise: %s)",
                        errno.errorcode.get(code, code))
            break
        done = end - first
    return done


def fits_in_memory(size: int) -> bool:
    """Whether `size` more bytes fit in the memory this process may still take: MemAvailable (0 where it cannot be
    read, as for the prefetch), and under a cgroup (v2) limit what is left of it; False logs why (a cache promised
    more memory than there is stays lazy)."""
    room = [r for r in (available_bytes(), cgroup_room()) if r is not None]
    if size > min(room):
        log.warning("the KV cache's pages are faulted in as steps first write them: its %d MiB exceed the %d MiB "
                    "of memory left", size >> 20, max(0, min(room)) >> 20)
        return False
    return True


def cgroup_room() -> int | None:
    """What is left of this cgroup's (v2) memory limit; None without one."""
    with contextlib.suppress(OSError, ValueError):
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    return None


def address_of(buffer: mmap.mmap) -> int:
    """Where a writable map starts in this process's memory."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class KVCache:
    def __init__(self, shape: CacheShape, *, num_device_blocks: int, num_swap_blocks: int,
                 device: torch.device, layer_slots: Sequence[int] | None = None, huge_pages: bool = False) -> None:
        if num_device_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one device block, got {num_device_blocks}")
        if num_swap_blocks < 0:
            raise ValueError(f"num_swap_blocks must be >= 0, got {num_swap_blocks}")
        self.shape = shape
        self.device = device
        self.num_device_blocks = num_device_blocks
        self.num_swap_blocks = num_swap_blocks
        self.is_cuda = device.type == "cuda"
        self.huge_pages = huge_pages
        self.device_kv = (lazy_zeros(shape.dims(num_device_blocks), shape.dtype, huge_pages) if device.type == "cpu"
                          else torch.zeros(shape.dims(num_device_blocks), dtype=shape.dtype, device=device))
        self.swap_kv = (torch.zeros(shape.block_first_dims(num_swap_blocks), dtype=shape.dtype, pin_memory=True)
                        if self.is_cuda else lazy_zeros(shape.dims(num_swap_blocks), shape.dtype, huge_pages))
        slots = range(shape.num_layers) if layer_slots is None else layer_slots
        self.layers = [(self.device_kv[i, 0], self.device_kv[i, 1]) for i in slots]
        self.swap_stream = torch.cuda.Stream(device=device) if self.is_cuda else None

    def populate(self, pause: Callable[[], object] = lambda: None) -> int:
        """Fault in the device blocks' pages on the CPU now (populate; the swap area stays lazy): bytes done."""
        return populate(self.device_kv, pause) if self.device.type == "cpu" else 0

    def swap_out(self, mapping: BlockMap) -> None:
        """Copy device blocks to swap blocks: mapping = [(device_block, swap_block)]."""
        if not mapping:
            return
        src, dst = self.split(mapping, self.num_device_blocks, self.num_swap_blocks, "swap_out")
        if self.swap_stream is None:
            self.swap_kv.index_copy_(2, dst, self.device_kv.index_select(2, src))
            return
        dst, src = by_swap_block(dst, src)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.swap_stream):
            self.swap_stream.wait_stream(compute)
            gathered = self.device_kv.movedim(2, 0).index_select(0, src.to(self.device, non_blocking=True))
            compute.wait_stream(self.swap_stream)
            for host, staged in self.swap_runs(dst, gathered):
                host.copy_(staged, non_blocking=True)
            done = self.swap_stream.record_event()
        done.synchronize()

    def swap_in(self, mapping: BlockMap) -> None:
        """Copy swap blocks to device blocks: mapping = [(swap_block, device_block)]."""
        if not mapping:
            return
        src, dst = self.split(mapping, self.num_swap_blocks, self.num_device_blocks, "swap_in")
        if self.swap_stream is None:
            self.device_kv.index_copy_(2, dst, self.swap_kv.index_select(2, src))
            return
        src, dst = by_swap_block(src, dst)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.swap_stream):
            self.swap_stream.wait_stream(compute)
            uploaded = torch.empty(self.shape.block_first_dims(len(mapping)), dtype=self.shape.dtype,
                                   device=self.device)
            for host, staged in self.swap_runs(src, uploaded):
                staged.copy_(host, non_blocking=True)
            self.device_kv.index_copy_(2, dst.to(self.device, non_blocking=True), uploaded.movedim(0, 2))
        compute.wait_stream(self.swap_stream)

    def swap_runs(self, swap_ids: Tensor, staged: Tensor) -> Iterator[tuple[Tensor, Tensor]]:
        """(swap area range, staged range) for each run of consecutive ids in sorted `swap_ids`, `staged` holding
        their blocks in that order, block first: the pairs one DMA each moves."""
        for start, first, count in contiguous_runs(swap_ids.tolist()):
            yield self.swap_kv[first:first + count], staged[start:start + count]

    def copy(self, mapping: BlockMap) -> None:
        """Copy device blocks to device blocks (copy-on-write): mapping = [(src_block, dst_block)]."""
        if not mapping:
            return
        src, dst = self.split(mapping, self.num_device_blocks, self.num_device_blocks, "copy")
        src, dst = src.to(self.device), dst.to(self.device)
        self.device_kv.index_copy_(2, dst, self.device_kv.index_select(2, src))

    @staticmethod
    def split(mapping: BlockMap, num_src: int, num_dst: int, what: str) -> tuple[Tensor, Tensor]:
        src = torch.tensor([s for s, _ in mapping], dtype=torch.long)
        dst = torch.tensor([d for _, d in mapping], dtype=torch.long)
        check_range(src, num_src, f"{what} source")
        check_range(dst, num_dst, f"{what} destination")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError(f"{what}: duplicate destination blocks in {mapping}")
        return src, dst


def by_swap_block(swap_ids: Tensor, device_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Both columns of a block mapping in the order of its swap blocks."""
    order = swap_ids.argsort()
    return swap_ids[order], device_ids[order]


def contiguous_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(position, first id, count) of each run of consecutive ids in `ids`: [4, 5, 6, 9, 10] gives
    [(0, 4, 3), (3, 9, 2)]."""
    runs: list[tuple[int, int, int]] = []
    for position, block in enumerate(ids):
        if runs and runs[-1][1] + runs[-1][2] == block:
            start, first, count = runs[-1]
            runs[-1] = (start, first, count + 1)
        else:
            runs.append((position, block, 1))
    return runs


def check_range(ids: Tensor, limit: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        raise ValueError(f"{what} block ids must be in [0, {limit}), got {ids.tolist()}")
