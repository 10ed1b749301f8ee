"""The device pool with reference counts and a prefix cache, and the CPU swap pool.

A device block is free when no request holds it. Allocation takes free blocks holding nothing worth
keeping first (a plain FIFO), then freed cached blocks in the order they were freed (an LRU queue), so
the least recently used cached block goes last and its key is evicted only then.

Each block also carries the prefix id of what it holds (see block_hash): a fresh number when the block is
registered under a key no other block holds, the holder's number when another block holds that key
already, NO_ID while unidentified. Reallocating a block resets it, and retires the number for good.

A block computed twice (two requests with the same prefix admitted before either registered it) is
registered twice: the key names one block, the primary, and the other held copies are its duplicates,
with the same prefix id. When the primary is freed while a duplicate is held, the key moves to the
duplicate and the freed copy holds nothing worth keeping; a copy registered while the primary sits free
takes the key over likewise. So a key (and the blocks after it) stays findable as long as any block with
its contents is held, and a free cached block never has a duplicate.
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
        self._duplicates: dict[BlockKey, list[int]] = {}  # held copies of a primary's contents, by key
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
            if key is not None:  # a free cached block is a primary without duplicates
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
                key = keys[i]
                if key is None:
                    empty.append(i)
                elif self._duplicates and key in self._duplicates:
                    self._drop_copy(i, key)
                    empty.append(i)
                else:
                    lru[i] = None

    def _drop_copy(self, block_id: int, key: BlockKey) -> None:
        """block_id, one of several held blocks with these contents, is freed: the key stays with a held one."""
        copies = self._duplicates[key]
        if self._cached[key] == block_id:
            self._cached[key] = copies.pop()
        else:
            copies.remove(block_id)
        if not copies:
            del self._duplicates[key]
        self._keys[block_id] = None

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Record that block_id, held, holds the KV of the full block key. The first block to do so gets a fresh
        prefix id; a later one takes that id and is registered as its duplicate (or takes the key over from a
        free primary), so the key outlives the first copy while this one is held. A block already identified is
        left as it is."""
        if self._ids[block_id] != NO_ID:
            return
        primary = self._cached.get(key)
        self._keys[block_id] = key
        if primary is None:
            self._cached[key] = block_id
            self._ids[block_id] = self._next_id
            self._next_id += 1
            return
        self._ids[block_id] = self._ids[primary]
        if self._refs[primary] == 0:  # free and cached: the held copy takes the key, the free one is empty
            self._cached[key] = block_id
            self._keys[primary] = None
            del self._lru[primary]
            self._empty.append(primary)
        else:
            self._duplicates.setdefault(key, []).append(block_id)

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
