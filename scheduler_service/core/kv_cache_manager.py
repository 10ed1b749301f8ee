"""KV-cache manager: block tables over a device pool and a CPU swap pool, with prefix caching.

The scheduler asks for blocks and gets them or None; tables, reference counts, the watermark and the
free queue stay in here. A full block that a request has computed is registered under its key (its
parent's prefix id and its tokens, compared whole: see block_hash) and stays findable after the request
frees it, until allocation evicts it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos.contract import BlockMap
from scheduler_service.core.block_hash import NO_ID, BlockTokens, Parent, extend_blocks, full_blocks, request_root
from scheduler_service.core.block_pool import DevicePool, SwapPool
from scheduler_service.core.request import Request

NO_BLOCKS: list[int] = []


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(slots=True)
class PrefixHit:
    """Blocks a new request takes instead of computing their tokens: blocks (held as they are) cover
    its first num_tokens tokens' full blocks; copy_from, if set, is a block whose contents it copies
    into a block of its own (copy-on-write of a sibling's partial block)."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    copy_from: int | None = None


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_device_blocks: int, num_swap_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.device = DevicePool(num_device_blocks)
        self.cpu = SwapPool(num_swap_blocks)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.usable_blocks = num_device_blocks - self.watermark_blocks
        self.prefix_stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        self._blocks: dict[str, list[BlockTokens]] = {}  # the token ids of a request's full blocks
        self._num_cached: dict[str, int] = {}
        self._copies: BlockMap = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usable_slots(self) -> int:
        """Token slots of the device pool a request may hold (the watermark kept back)."""
        return self.usable_blocks * self.block_size

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's device table holds."""
        return len(self._tables.get(request_id, ())) * self.block_size

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, NO_BLOCKS)

    def cpu_table(self, request_id: str) -> list[int]:
        return self._cpu_tables.get(request_id, NO_BLOCKS)

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ())) + len(self._cpu_tables.get(request_id, ()))

    def never_fits(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) > self.usable_blocks

    # ---- admission ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest run of cached full blocks starting the request's tokens, leaving at least its
        last token to compute (its logits are needed). None for a request that wants prompt logprobs: they come
        from computing the prompt (vLLM also skips the cache hit for it)."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return PrefixHit()
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = extend_blocks(self._blocks.setdefault(request.request_id, []), request, max_blocks,
                               self.block_size)
        blocks = self._find(tokens[:max_blocks], request_root(request))
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def _find(self, tokens: list[BlockTokens], root: Parent) -> list[int]:
        """The cached blocks holding these full blocks' tokens after the same prefix (of the scope whose root
        is given), from the first on."""
        blocks: list[int] = []
        lookup, prefix_id = self.device.lookup, self.device.prefix_id
        parent: Parent = root
        for block_tokens in tokens:
            block = lookup((parent, block_tokens))
            if block is None:
                break
            blocks.append(block)
            parent = prefix_id(block)
        return blocks

    def cached_prefix_tokens(self, request: Request) -> int:
        """How many leading tokens of the request's prompt sit in cached full blocks of its cache scope (0 with
        caching off); it need not be queued here."""
        if not self.enable_caching:
            return 0
        return len(self._find(full_blocks(request.prompt_token_ids, self.block_size), request_root(request))) \
            * self.block_size

    def fork_blocks(self, request: Request, source_id: str) -> PrefixHit | None:
        """Share a running sibling's prompt blocks (same prompt, already computed): every full block
        before the prompt's last token, and a copy of the block holding that token, which the request
        computes again for its own first sample."""
        table = self._tables.get(source_id)
        last = request.num_prompt_tokens - 1
        if table is None or len(table) <= last // self.block_size:
            return None
        kept = last // self.block_size
        return PrefixHit(table[:kept], last, table[kept])

    def can_admit(self, hit: PrefixHit, num_slots: int) -> AllocStatus:
        need = self.blocks_for(num_slots) - len(hit.blocks) + self.device.evictable(hit.blocks)
        if self.device.num_free - need < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def admit(self, request: Request, hit: PrefixHit, num_slots: int) -> list[int]:
        """Give a new request its table: the hit's blocks, a copy of hit.copy_from, fresh blocks up to
        num_slots. Call can_admit first. The whole table is returned (the executor is sent all of it)."""
        rid = request.request_id
        self.device.touch(hit.blocks)
        table = self._tables[rid] = list(hit.blocks)
        # Registration goes on after the leading hit blocks the pool has identified (all of a cache hit;
        # a sibling's blocks are identified once its prompt is computed, which sharing waits for).
        known = 0
        if self.enable_caching:
            prefix_id = self.device.prefix_id
            while known < len(table) and prefix_id(table[known]) != NO_ID:
                known += 1
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += hit.num_tokens
        self._num_cached[rid] = known
        fresh = self.device.allocate(self.blocks_for(num_slots) - len(table))
        if fresh is None:
            raise RuntimeError(f"device pool short admitting {rid}: call can_admit first")
        if hit.copy_from is not None and fresh:
            self._copies.append((hit.copy_from, fresh[0]))
        table.extend(fresh)
        return table

    # ---- growth and release -----------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead: int = 0) -> list[int] | None:
        """Extend a running request's table to hold its computed tokens, num_new_tokens more and the
        lookahead slots; the new block ids (often none), or None if the pool is short."""
        table = self._tables[request.request_id]
        missing = -(-(request.num_computed_tokens + num_new_tokens + num_lookahead) // self.block_size) - len(table)
        if missing <= 0:
            return NO_BLOCKS
        new = self.device.allocate(missing)
        if new is not None:
            table.extend(new)
        return new

    def grow_tables(self, request_ids: list[str], num_blocks: list[int]) -> list[list[int]] | None:
        """Extend several running requests' tables at once, by num_blocks[i] blocks each; their new
        blocks, or None (nothing changed) if the pool is short of the sum."""
        fresh = self.device.allocate(sum(num_blocks))
        if fresh is None:
            return None
        tables = self._tables
        if len(fresh) == len(request_ids):
            for rid, block in zip(request_ids, fresh, strict=True):
                tables[rid].append(block)
            return [[block] for block in fresh]
        grown, start = [], 0
        for rid, n in zip(request_ids, num_blocks, strict=True):
            new = fresh[start:start + n]
            tables[rid].extend(new)
            grown.append(new)
            start += n
        return grown

    def release_tail(self, request_id: str, num_blocks: int) -> None:
        """Give back the last num_blocks of a table (granted this step, holding no data)."""
        table = self._tables.get(request_id)
        if table and num_blocks > 0:
            self.device.release(table[-num_blocks:])
            del table[-num_blocks:]

    def cache_blocks(self, *requests: Request) -> None:
        """Register each request's full blocks computed so far (call when its computed count crosses a
        block boundary); they are then found by look-ups and stay cached after it frees them."""
        if not self.enable_caching:
            return
        tables = self._tables
        for request in requests:
            table = tables.get(request.request_id)
            if table is not None:
                self._cache_computed(request, table)

    def _cache_computed(self, request: Request, table: list[int]) -> None:
        rid = request.request_id
        done = self._num_cached.get(rid, 0)
        full = min(request.num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        tokens = extend_blocks(self._blocks.setdefault(rid, []), request, full, self.block_size)
        device = self.device
        for i in range(done, full):
            parent = device.prefix_id(table[i - 1]) if i else request_root(request)
            if parent == NO_ID:  # cannot happen: blocks are registered in order, each after its parent
                full = i
                break
            device.cache(table[i], (parent, tokens[i]))
        self._num_cached[rid] = full

    def free(self, request: Request) -> None:
        """Release everything the request holds; its computed full blocks stay cached."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            if self.enable_caching:
                self._cache_computed(request, table)
            self.device.release(table)
        self.cpu.release(self._cpu_tables.pop(rid, NO_BLOCKS))
        self._blocks.pop(rid, None)
        self._num_cached.pop(rid, None)

    # ---- swap --------------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        return len(self._tables.get(request_id, ())) <= self.cpu.num_free

    def swap_out(self, request: Request) -> BlockMap:
        """Copy every block of the request to the swap pool and drop its device holds. A block shared
        with another request is copied too and stays on the device for the others."""
        rid = request.request_id
        table = self._tables.pop(rid)
        cpu_ids = self.cpu.allocate(len(table))
        if cpu_ids is None:
            raise RuntimeError(f"swap pool short for {rid}: call can_swap_out first")
        if self.enable_caching:
            self._cache_computed(request, table)
        self.device.release(table)
        self._num_cached[rid] = 0
        self._cpu_tables[rid] = cpu_ids
        return list(zip(table, cpu_ids, strict=True))

    def can_swap_in(self, request_id: str, extra_blocks: int = 0) -> bool:
        need = len(self._cpu_tables.get(request_id, ())) + extra_blocks
        return self.device.num_free - need >= self.watermark_blocks

    def swap_in(self, request: Request) -> BlockMap:
        """Bring a swapped request back into fresh device blocks (its swap blocks free at the step's end)."""
        rid = request.request_id
        cpu_ids = self._cpu_tables.pop(rid)
        table = self.device.allocate(len(cpu_ids))
        if table is None:
            raise RuntimeError(f"device pool short for {rid}: call can_swap_in first")
        self.cpu.release_after_step(cpu_ids)
        self._tables[rid] = table
        self._num_cached[rid] = 0
        if self.enable_caching:
            self._cache_computed(request, table)
        return list(zip(cpu_ids, table, strict=True))

    # ---- step and lifetime -------------------------------------------------------------

    def end_step(self) -> BlockMap:
        """Close a step: swap blocks read by its swap-ins become free; the step's copies are returned."""
        self.cpu.end_step()
        copies, self._copies = self._copies, []
        return copies
