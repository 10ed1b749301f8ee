"""KV-cache manager: block tables over a device pool and a CPU swap pool, with prefix caching.

The scheduler asks for blocks and gets them or None; tables, reference counts, the watermark and the
free queue stay in here. A full block that a request has computed is registered under its key (its
parent's prefix id and its tokens, compared whole: see block_hash) and stays findable after the request
frees it, until allocation evicts it.

A hybrid model (sliding-window layers beside full-attention ones) has window groups (window_groups.py): their
tables hold only the blocks the window still reads, allocated as the request's steps need them; a prefix hit
counts for them only where every window group's blocks of the window before it are cached. With rings
(Capabilities.kv_window_ring) the window tables are R blocks reused in place: never cached, so no hit at all.
A model whose every layer slides (Capabilities.kv_window_only, rings) has one window group and no full-attention
table: a request's block table stays empty and it holds its ring only, whatever its length.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos.contract import BlockMap
from scheduler_service.core.block_hash import NO_ID, BlockTokens, Parent, extend_blocks, full_blocks, request_root
from scheduler_service.core.block_pool import DevicePool, SwapPool
from scheduler_service.core.request import Request
from scheduler_service.core.window_groups import WindowBlocks, WindowGroups

NO_BLOCKS: list[int] = []
UNBOUNDED_BLOCKS = 1 << 40
"""A full ring's reach, in blocks of positions: it covers every position (window-only models)."""


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
    window: WindowBlocks | None = None  # hybrid models: the window groups' cached blocks the hit takes


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_device_blocks: int, num_swap_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_caching: bool = True, window_groups: int = 0, window: int = 0,
                 max_step_tokens: int = 0, window_ring: bool = False, window_only: bool = False) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.device = DevicePool(num_device_blocks)
        self.cpu = SwapPool(num_swap_blocks)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.windows = (WindowGroups(self.device, window_groups, window, block_size, window_ring)
                        if window_groups > 0 and window > 0 else None)
        self.window_only = window_only and window_ring and self.windows is not None  # no full-attention table
        self.enable_caching = enable_caching and not self.window_only  # rings only: nothing to cache
        self.usable_blocks = self._usable_table_blocks(num_device_blocks - self.watermark_blocks, max_step_tokens)
        self.prefix_stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        self._blocks: dict[str, list[BlockTokens]] = {}  # the token ids of a request's full blocks
        self._num_cached: dict[str, int] = {}
        self._copies: BlockMap = []
        self._cpu_windows: dict[str, tuple[int, int, int]] = {}  # swapped: full blocks, window start, length

    def _usable_table_blocks(self, usable: int, max_step_tokens: int) -> int:
        """The longest full-attention table a request may hold (the window groups' blocks beside it, at their
        most, fit in the usable pool too)."""
        windows = self.windows
        if windows is None:
            return usable
        if self.window_only:  # a request holds its rings only: any length fits once they do
            ring_fits = windows.num_groups * windows.ring_size <= usable
            return UNBOUNDED_BLOCKS if ring_fits else usable // windows.num_groups
        cap = windows.max_blocks(usable * self.block_size, max(1, max_step_tokens))
        if usable - windows.num_groups * cap >= cap:
            return usable - windows.num_groups * cap
        return usable // (1 + windows.num_groups)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def usable_slots(self) -> int:
        """Token slots of the device pool a request may hold (the watermark kept back)."""
        return self.usable_blocks * self.block_size

    def num_slots(self, request_id: str) -> int:
        """Token slots the request's device tables hold (every group's: a window group's end may come first)."""
        blocks = len(self._tables.get(request_id, ()))
        if self.windows is not None:
            covered = self.windows.covered_end(request_id)
            if self.window_only:
                blocks = UNBOUNDED_BLOCKS if covered is None else covered
            else:
                blocks = blocks if covered is None else min(blocks, covered)
        return blocks * self.block_size

    def full_blocks_for(self, num_slots: int) -> int:
        """Blocks of the full-attention table that num_slots take (none for a window-only model)."""
        return 0 if self.window_only else self.blocks_for(num_slots)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, NO_BLOCKS)

    def cpu_table(self, request_id: str) -> list[int]:
        return self._cpu_tables.get(request_id, NO_BLOCKS)

    def num_blocks_held(self, request_id: str) -> int:
        held = len(self._tables.get(request_id, ())) + len(self._cpu_tables.get(request_id, ()))
        return held + self.windows.num_held(request_id) if self.windows is not None else held

    def window_table(self, request_id: str) -> WindowBlocks | None:
        """A hybrid model's window groups' tables of a running request (None otherwise)."""
        return self.windows.tables.get(request_id) if self.windows is not None else None

    def never_fits(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) > self.usable_blocks

    # ---- admission ---------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> PrefixHit:
        """The longest run of cached full blocks starting the request's tokens, leaving at least its
        last token to compute (its logits are needed). None for a request that wants prompt logprobs: they come
        from computing the prompt (vLLM also skips the cache hit for it)."""
        if not self.enable_caching or request.wants_prompt_logprobs:
            return PrefixHit()
        if self.windows is not None and self.windows.ring:  # rings are overwritten in place: never cached
            return PrefixHit()
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = extend_blocks(self._blocks.setdefault(request.request_id, []), request, max_blocks,
                               self.block_size)
        blocks = self._find(tokens[:max_blocks], request_root(request))
        if self.windows is None:
            return PrefixHit(blocks, len(blocks) * self.block_size)
        return self._window_hit(blocks, tokens, request_root(request))

    def _window_hit(self, blocks: list[int], tokens: list[BlockTokens], root: Parent) -> PrefixHit:
        """The longest prefix of a full-attention hit whose window (the blocks its next query reads) is cached in
        every window group too: vLLM V1's rule for sliding-window layers. Its window blocks come with it."""
        windows, device = self.windows, self.device
        assert windows is not None
        found: list[list[int | None]] = []
        run = [0] * (len(blocks) + 1)  # run[k]: cached window positions ending at position k - 1
        for i in range(len(blocks)):
            parent = device.prefix_id(blocks[i - 1]) if i else root
            found.append([device.lookup((parent, tokens[i], g)) for g in range(windows.num_groups)])
            run[i + 1] = run[i] + 1 if None not in found[i] else 0
        for k in range(len(blocks), 0, -1):
            start = windows.first_kept(k * self.block_size)
            if run[k] >= k - start:
                groups = [[found[i][g] for i in range(start, k)] for g in range(windows.num_groups)]
                return PrefixHit(blocks[:k], k * self.block_size, window=WindowBlocks(start, groups))  # type: ignore[arg-type]
        return PrefixHit()

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
        if self.windows is not None:  # a sibling's window has moved on: the prefix cache finds what is left
            return None
        last = request.num_prompt_tokens - 1
        if table is None or len(table) <= last // self.block_size:
            return None
        kept = last // self.block_size
        return PrefixHit(table[:kept], last, table[kept])

    def can_admit(self, hit: PrefixHit, num_slots: int, chunk_end: int | None = None, reserved: int = 0) -> AllocStatus:
        """Whether the request's table of num_slots fits now (its window groups' tables up to chunk_end, the end
        of its first step's slots), `reserved` blocks left free beside it."""
        need = reserved + self.full_blocks_for(num_slots) - len(hit.blocks) + self.device.evictable(hit.blocks)
        if self.windows is not None:
            held = hit.window.flat() if hit.window is not None else []
            end = self.blocks_for(min(num_slots if chunk_end is None else chunk_end, num_slots))
            need += self.windows.num_groups * self.windows.first_blocks(end, len(hit.blocks))
            need += self.device.evictable(held)
        if self.device.num_free - need < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def next_window_growth(self, request: Request, num_tokens: int, lookahead: int) -> int:
        """Blocks a hybrid model's request takes when its window tables grow by num_tokens past what they cover
        (never past its known tokens and the lookahead slots): a chunked prefill's next chunk. 0 without window
        groups."""
        windows = self.windows
        covered = windows.covered_end(request.request_id) if windows is not None else None
        if windows is None or covered is None:
            return 0
        end = min(request.num_tokens + lookahead, covered * self.block_size + num_tokens)
        return windows.num_groups * windows.missing(request.request_id, self.blocks_for(end), 0)

    def admit(self, request: Request, hit: PrefixHit, num_slots: int, chunk_end: int | None = None) -> list[int]:
        """Give a new request its table: the hit's blocks, a copy of hit.copy_from, fresh blocks up to
        num_slots (window groups: up to chunk_end). Call can_admit first. The whole table is returned (the
        executor is sent all of it)."""
        rid = request.request_id
        self.device.touch(hit.blocks)
        if hit.window is not None:  # before allocating, which would take them while they sit free
            self.device.touch(hit.window.flat())
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
        num_fresh = self.full_blocks_for(num_slots) - len(table)
        num_window = 0
        if self.windows is not None:
            end = self.blocks_for(min(num_slots if chunk_end is None else chunk_end, num_slots))
            num_window = self.windows.num_groups * self.windows.missing(rid, end, len(table))
        fresh = self.device.allocate(num_fresh + num_window)
        if fresh is None:
            raise RuntimeError(f"device pool short admitting {rid}: call can_admit first")
        if hit.copy_from is not None and fresh:
            self._copies.append((hit.copy_from, fresh[0]))
        if self.windows is not None:
            self._open_windows(rid, hit, fresh[num_fresh:])
        table.extend(fresh[:num_fresh])
        return table

    def _open_windows(self, request_id: str, hit: PrefixHit, fresh: list[int]) -> None:
        assert self.windows is not None
        if hit.window is None:
            self.windows.open(request_id, 0, [])
        else:
            self.windows.open(request_id, hit.window.start, hit.window.groups)
        self.windows.extend(request_id, fresh)

    # ---- growth and release -----------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int, num_lookahead: int = 0) -> list[int] | None:
        """Extend a running request's table to hold its computed tokens, num_new_tokens more and the
        lookahead slots; the new block ids (often none), or None if the pool is short."""
        table = self._tables[request.request_id]
        end = -(-(request.num_computed_tokens + num_new_tokens + num_lookahead) // self.block_size)
        missing = 0 if self.window_only else end - len(table)
        if self.windows is not None:
            return self._allocate_hybrid(request, table, max(0, missing), end)
        if missing <= 0:
            return NO_BLOCKS
        new = self.device.allocate(missing)
        if new is not None:
            table.extend(new)
        return new

    def _allocate_hybrid(self, request: Request, table: list[int], missing: int, end: int) -> list[int] | None:
        """allocate_slots with window groups: out-of-window blocks go back first, then the full table and the
        window tables grow to `end` in one allocation."""
        windows = self.windows
        assert windows is not None
        self.release_window(request)
        window_missing = windows.missing(request.request_id, end, 0) * windows.num_groups
        if missing == 0 and window_missing == 0:
            return NO_BLOCKS
        new = self.device.allocate(missing + window_missing)
        if new is None:
            return None
        table.extend(new[:missing])
        windows.extend(request.request_id, new[missing:])
        return new[:missing]

    def release_window(self, request: Request) -> None:
        """Give back the request's window-group blocks that no query of it reads again (registered in the prefix
        cache first)."""
        windows = self.windows
        if windows is None:
            return
        rid = request.request_id
        table = windows.tables.get(rid)
        if table is None or windows.ring or windows.first_kept(request.num_computed_tokens) <= table.start:
            return
        if self.enable_caching and rid in self._tables:
            self._cache_computed(request, self._tables[rid])
        self.device.release(windows.release_out_of_window(rid, request.num_computed_tokens))

    def grow_tables(self, requests: list[Request], num_blocks: list[int]) -> list[list[int]] | None:
        """Extend several running requests' tables at once, by num_blocks[i] blocks each (window groups: to the
        same length); their new blocks, or None (nothing changed) if the pool is short of the sum."""
        if self.windows is not None:
            return self._grow_hybrid(requests, num_blocks)
        request_ids = [r.request_id for r in requests]
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

    def _grow_hybrid(self, requests: list[Request], num_blocks: list[int]) -> list[list[int]] | None:
        """grow_tables with window groups: each request's tables grow to num_slots + num_blocks[i] blocks."""
        windows, tables = self.windows, self._tables
        assert windows is not None
        ends = [self.num_slots(r.request_id) // self.block_size + n for r, n in zip(requests, num_blocks, strict=True)]
        for request in requests:
            self.release_window(request)
        full = [0 if self.window_only else max(0, end - len(tables[r.request_id]))
                for r, end in zip(requests, ends, strict=True)]
        window_missing = [windows.missing(r.request_id, end, 0) * windows.num_groups
                          for r, end in zip(requests, ends, strict=True)]
        fresh = self.device.allocate(sum(full) + sum(window_missing))
        if fresh is None:
            return None
        grown, start = [], 0
        for request, n, w in zip(requests, full, window_missing, strict=True):
            new = fresh[start:start + n]
            tables[request.request_id].extend(new)
            windows.extend(request.request_id, fresh[start + n:start + n + w])
            grown.append(new)
            start += n + w
        return grown

    def release_tail(self, request_id: str, num_blocks: int) -> None:
        """Give back the last num_blocks of a table, and the window groups' blocks of this step (granted this
        step, holding no data)."""
        table = self._tables.get(request_id)
        if table and num_blocks > 0:
            self.device.release(table[-num_blocks:])
            del table[-num_blocks:]
        if self.windows is not None:
            self.device.release(self.windows.undo_step(request_id))

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
        window = self.windows.tables.get(rid) if self.windows is not None else None
        for i in range(done, full):
            parent = device.prefix_id(table[i - 1]) if i else request_root(request)
            if parent == NO_ID:  # cannot happen: blocks are registered in order, each after its parent
                full = i
                break
            device.cache(table[i], (parent, tokens[i]))
            if window is not None and not self.windows.ring and window.start <= i < window.end:  # type: ignore[union-attr]
                for g, group in enumerate(window.groups):
                    device.cache(group[i - window.start], (parent, tokens[i], g))
        self._num_cached[rid] = full

    def free(self, request: Request) -> None:
        """Release everything the request holds; its computed full blocks stay cached."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is not None:
            if self.enable_caching:
                self._cache_computed(request, table)
            self.device.release(table)
        if self.windows is not None:
            window = self.windows.pop(rid)
            if window is not None:
                self.device.release(window.flat())
            self._cpu_windows.pop(rid, None)
        self.cpu.release(self._cpu_tables.pop(rid, NO_BLOCKS))
        self._blocks.pop(rid, None)
        self._num_cached.pop(rid, None)

    # ---- swap --------------------------------------------------------------------------

    def can_swap_out(self, request_id: str) -> bool:
        return self.num_blocks_held(request_id) <= self.cpu.num_free

    def swap_out(self, request: Request) -> BlockMap:
        """Copy every block of the request to the swap pool and drop its device holds. A block shared
        with another request is copied too and stays on the device for the others."""
        rid = request.request_id
        self.release_window(request)
        table = self._tables[rid]
        blocks = table
        window = self.windows.tables.get(rid) if self.windows is not None else None
        if window is not None:
            blocks = table + window.flat()
        cpu_ids = self.cpu.allocate(len(blocks))
        if cpu_ids is None:
            raise RuntimeError(f"swap pool short for {rid}: call can_swap_out first")
        if self.enable_caching:
            self._cache_computed(request, table)
        del self._tables[rid]
        if window is not None and self.windows is not None:
            self.windows.pop(rid)
            self._cpu_windows[rid] = (len(table), window.start, window.length)
        self.device.release(blocks)
        self._num_cached[rid] = 0
        self._cpu_tables[rid] = cpu_ids
        return list(zip(blocks, cpu_ids, strict=True))

    def can_swap_in(self, request_id: str, num_slots: int) -> bool:
        """Whether the swapped request fits back with tables of num_slots slots."""
        cpu_ids = self._cpu_tables.get(request_id, ())
        end = self.blocks_for(num_slots)
        layout = self._cpu_windows.get(request_id)
        if layout is None:
            need = max(len(cpu_ids), end)
        else:
            num_full, start, length = layout
            assert self.windows is not None
            grow = min(end, self.windows.ring_size) - length if self.windows.ring else end - start - length
            full = 0 if self.window_only else max(0, end - num_full)
            need = len(cpu_ids) + full + self.windows.num_groups * max(0, grow)
        return self.device.num_free - need >= self.watermark_blocks

    def swap_in(self, request: Request) -> BlockMap:
        """Bring a swapped request back into fresh device blocks (its swap blocks free at the step's end)."""
        rid = request.request_id
        cpu_ids = self._cpu_tables.pop(rid)
        blocks = self.device.allocate(len(cpu_ids))
        if blocks is None:
            raise RuntimeError(f"device pool short for {rid}: call can_swap_in first")
        self.cpu.release_after_step(cpu_ids)
        table = blocks
        layout = self._cpu_windows.pop(rid, None)
        if layout is not None and self.windows is not None:
            num_full, start, length = layout
            self.windows.open(rid, start, [blocks[num_full + g * length:num_full + (g + 1) * length]
                                           for g in range(self.windows.num_groups)])
            table = blocks[:num_full]
        self._tables[rid] = table
        self._num_cached[rid] = 0
        if self.enable_caching:
            self._cache_computed(request, table)
        return list(zip(cpu_ids, blocks, strict=True))

    # ---- step and lifetime -------------------------------------------------------------

    def end_step(self) -> BlockMap:
        """Close a step: swap blocks read by its swap-ins become free; the step's copies are returned."""
        self.cpu.end_step()
        if self.windows is not None:
            self.windows.end_step()
        copies, self._copies = self._copies, []
        return copies
