"""The device pool with reference counts and a prefix cache, and the CPU swap pool.

A device block is free when no request holds it. Allocation takes free blocks holding nothing worth
keeping first (a plain FIFO), then freed cached blocks in the order they were freed (an LRU queue), so
the least recently used cached block goes last and its key is evicted only then.

Each block also carries the prefix id of what it holds (see block_hash): a fresh number when the block is
registered under a key no other block holds, the holder's number when another block holds that key
already, NO_ID while unidentified. Reallocating a block resets it, and retires the number for good.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from scheduler_service.core.block_hash import NO_ID, ROOT, BlockKey


class DevicePool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._ids = [NO_ID] * num_blocks
        self._next_id = ROOT + 1
        self._empty: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_blocks(self) -> set[int]:
        return {*self._empty, *self._lru}

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (each held once), evicting cached contents; None if fewer are free."""
        empty = self._empty
        if n > len(empty) + len(self._lru):
            return None
        if n <= len(empty):
            ids = [empty.popleft() for _ in range(n)]
        else:
            ids = [*empty, *(self._lru.popitem(last=False)[0] for _ in range(n - len(empty)))]
            empty.clear()
        refs, keys, prefix_ids = self._refs, self._keys, self._ids
        for i in ids:
            refs[i] = 1
            prefix_ids[i] = NO_ID
            key = keys[i]
            if key is not None:
                keys[i] = None
                if self._cached.get(key) == i:
                    del self._cached[key]
        return ids

    def touch(self, ids: list[int]) -> None:
        """Hold blocks another request (or the cache) already has; a free one leaves the free queue."""
        refs, lru = self._refs, self._lru
        for i in ids:
            if refs[i] == 0:
                del lru[i]  # only a cached block can be found while free
            refs[i] += 1

    def release(self, ids: list[int]) -> None:
        """Drop one hold on each block, last first, so a request's tail is evicted before its head."""
        refs, lru, empty, keys = self._refs, self._lru, self._empty, self._keys
        for i in reversed(ids):
            refs[i] -= 1
            if refs[i] == 0:
                if keys[i] is None:
                    empty.append(i)
                else:
                    lru[i] = None

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Record that block_id holds the KV of the full block key (the first block to do so keeps it,
        and a later one takes its prefix id). A block already identified is left as it is."""
        if self._ids[block_id] != NO_ID:
            return
        holder = self._cached.get(key)
        if holder is not None:
            self._ids[block_id] = self._ids[holder]
            return
        self._cached[key] = block_id
        self._keys[block_id] = key
        self._ids[block_id] = self._next_id
        self._next_id += 1

    def lookup(self, key: BlockKey) -> int | None:
        """The block cached under exactly this key (equal parent id and equal tokens), or None."""
        return self._cached.get(key)

    def prefix_id(self, block_id: int) -> int:
        """The prefix id of what the block holds (NO_ID if it was never registered since it was allocated)."""
        return self._ids[block_id]

    def evictable(self, ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (touching them takes them out of it)."""
        refs = self._refs
        return sum(1 for i in ids if refs[i] == 0)


class SwapPool:
    """CPU swap blocks. Blocks read by a swap-in become free only at the end of the step."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._released_this_step: list[int] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self._free.extend(ids)

    def release_after_step(self, ids: list[int]) -> None:
        self._released_this_step.extend(ids)

    def end_step(self) -> None:
        self._free.extend(self._released_this_step)
        self._released_this_step = []
