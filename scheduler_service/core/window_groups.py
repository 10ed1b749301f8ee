"""Block tables of a hybrid model's sliding-window layers (Gemma 2/3, GPT-OSS): vLLM V1's KV cache groups, in
our own shape.

The executor splits its layers into KV cache groups of equal size: one group of the full-attention layers
and `num_groups` groups of sliding-window layers (the last one padded), each group's page of a block holding
its layers' KV of block_size tokens. Every group draws its blocks from the one device pool, so a block id
names a page of one group at a time, and swaps and copies stay block-id mappings. The full-attention group's
table is the KV-cache manager's table as ever; this module keeps the window groups' tables.

A window group at query position p reads keys [p - window + 1, p] only, so once a request has computed c
tokens its window blocks before position released_before(c) are never read again: they go back to the pool
(registered in the prefix cache first, so a later request with the same prefix may still find them). Every
window group holds the same positions [start, end): blocks before `start` are released, blocks from `end` on
are not allocated yet. Window blocks are allocated only up to what the step computes (never the whole prompt
up front as the full group is), so a long request holds O(window + chunk) window blocks, not O(length).

With an executor that keeps rings (Capabilities.kv_window_ring), a window group's table is instead a ring of
R = ceil(window / block_size) + 1 blocks allocated as the request first reaches them and kept until it ends:
block i lives in ring[i % R], the executor reads a step's window before writing the step's keys over it, so a
request holds at most R blocks per window group, prefill chunks included. A ring's blocks are overwritten in
place, so they are never registered in the prefix cache and a hybrid model then gets no prefix hits.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos.contract import released_before, ring_blocks
from scheduler_service.core.block_pool import DevicePool


@dataclass(slots=True)
class WindowBlocks:
    """Per window group, the blocks of positions [start, start + len(groups[g])), every group the same
    positions. As a step's news for a running request: start, and the blocks appended this step."""

    start: int
    groups: list[list[int]]

    @property
    def length(self) -> int:
        return len(self.groups[0]) if self.groups else 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def flat(self) -> list[int]:
        return [block for group in self.groups for block in group]


class WindowGroups:
    """The window groups' tables of one KV-cache manager, and their growth in the current step."""

    def __init__(self, device: DevicePool, num_groups: int, window: int, block_size: int, ring: bool = False) -> None:
        self.device = device
        self.num_groups = num_groups
        self.window = window
        self.block_size = block_size
        self.ring = ring
        self.ring_size = ring_blocks(window, block_size)  # blocks of a full ring (ring mode)
        self.tables: dict[str, WindowBlocks] = {}
        self.grown: dict[str, list[list[int]]] = {}  # blocks appended this step, per group

    def first_kept(self, num_computed: int) -> int:
        return released_before(num_computed, self.window, self.block_size)

    def num_held(self, request_id: str) -> int:
        table = self.tables.get(request_id)
        return table.length * self.num_groups if table is not None else 0

    def max_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """Most blocks per group a request of num_tokens tokens holds at once, when a step computes at most
        max_step_tokens of its tokens (the window before the step's first query, and the step's own; a ring: R)."""
        if self.ring:
            return min(-(-num_tokens // self.block_size), self.ring_size)
        return min(-(-num_tokens // self.block_size), -(-(self.window - 1 + max_step_tokens) // self.block_size) + 1)

    def missing(self, request_id: str, end: int, start: int) -> int:
        """Blocks per group to allocate so that the request's tables reach block `end` (counted from `start`
        for a request without tables yet; a ring grows to R blocks at most)."""
        table = self.tables.get(request_id)
        if table is None:
            return self.first_blocks(end, start)
        if self.ring:
            return max(0, min(end, self.ring_size) - table.length)
        return max(0, end - table.end)

    def first_blocks(self, end: int, hit_end: int) -> int:
        """Blocks per group a new request's tables take to reach block `end`, a prefix hit giving up to
        `hit_end` (a ring: no hit, R blocks at most)."""
        return min(end, self.ring_size) if self.ring else max(0, end - hit_end)

    def covered_end(self, request_id: str) -> int | None:
        """The block index up to which the request's window tables hold its positions (None: every position, a
        full ring; 0 without tables)."""
        table = self.tables.get(request_id)
        if table is None:
            return 0
        if self.ring and table.length >= self.ring_size:
            return None
        return table.end

    def open(self, request_id: str, start: int, hit: list[list[int]]) -> None:
        """A request's tables from `start` on, beginning with cached blocks it holds (already touched)."""
        self.tables[request_id] = WindowBlocks(start, [list(group) for group in hit] or
                                               [[] for _ in range(self.num_groups)])

    def extend(self, request_id: str, blocks: list[int]) -> None:
        """Append fresh blocks (held once): len(blocks) / num_groups to each group, in group order."""
        if not blocks:
            return
        table = self.tables[request_id]
        per_group = len(blocks) // self.num_groups
        grown = self.grown.setdefault(request_id, [[] for _ in range(self.num_groups)])
        for g in range(self.num_groups):
            new = blocks[g * per_group:(g + 1) * per_group]
            table.groups[g].extend(new)
            grown[g].extend(new)

    def release_out_of_window(self, request_id: str, num_computed: int) -> list[int]:
        """Drop the blocks before the window of the next query (the caller registers them in the prefix
        cache first); the released blocks, which the caller gives back to the pool. A ring releases nothing."""
        table = self.tables.get(request_id)
        if table is None or self.ring:
            return []
        cut = min(self.first_kept(num_computed), table.end) - table.start
        if cut <= 0:
            return []
        released = [block for group in table.groups for block in group[:cut]]
        for group in table.groups:
            del group[:cut]
        table.start += cut
        return released

    def undo_step(self, request_id: str) -> list[int]:
        """Take back the blocks appended this step (the request's step was withdrawn); those blocks."""
        grown = self.grown.pop(request_id, None)
        table = self.tables.get(request_id)
        if grown is None or table is None:
            return []
        for group, new in zip(table.groups, grown, strict=True):
            if new:
                del group[-len(new):]
        return [block for new in grown for block in new]

    def pop(self, request_id: str) -> WindowBlocks | None:
        self.grown.pop(request_id, None)
        return self.tables.pop(request_id, None)

    def news(self, request_id: str, whole: bool) -> WindowBlocks | None:
        """What the executor is told of the request's tables this step: all of them (a request new to it or
        resumed), else the blocks appended (None when none were)."""
        table = self.tables.get(request_id)
        if table is None:
            return None
        if whole:
            return WindowBlocks(table.start, [list(group) for group in table.groups])
        grown = self.grown.get(request_id)
        return None if grown is None else WindowBlocks(table.start, grown)

    def end_step(self) -> None:
        self.grown = {}
