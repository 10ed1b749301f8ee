"""An in-process executor model for core tests: it keeps a fake KV cache whose every slot records
(position, digest of the tokens up to it) -- what a real model's KV at that slot depends on. Before
each forward it checks that a request's computed positions hold exactly what computing them itself
would have written (so a shared or cached block must equal a recompute), and that every block it
writes is held by no other live request (a shared block is copied first). It applies swap and copy
mappings the way a real executor must. Draft tokens (speculative decoding) are computed into their slots
like any token and verified against the model's tokens: a rejected draft leaves a slot whose record names
tokens the request never had, so any later read of it is caught as corruption.

With window groups (a hybrid model's sliding-window layers) it keeps each request's window tables as the torch
executor does: a record names its group too, the window layers read only the last `window` positions, through
their own tables, and after each step it drops the blocks before the next query's window itself. A read of a
position before its window table's start is corruption; held_blocks() is what the scheduler must still hold.
With window_ring (Capabilities.kv_window_ring) a window table is a ring: block i of the sequence is ring[i % R],
R = ceil(window / block_size) + 1, a step reads its window before it writes, and nothing is dropped early; a read
of a slot a later position overwrote is corruption too. With window_only (Capabilities.kv_window_only: every layer
slides) no layer reads or writes the block table, which must come empty: the rings hold everything."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from protos.contract import ring_blocks
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput

Slot = tuple[int, int, int] | None  # (group, position, digest of the tokens up to it)


COPY_PERIOD = 6


def copies(rid: str) -> bool:
    """A third of the random traces' requests (ids r<i>.<j>) get a model that repeats itself every COPY_PERIOD
    positions, so that n-gram drafts of their outputs are often right."""
    return "." in rid and hashlib.blake2b(rid.encode(), digest_size=1).digest()[0] % 3 == 0


def token_at(rid: str, position: int, eos: int | None = None, eos_every: int = 0) -> int:
    key = position % COPY_PERIOD if copies(rid) else position
    h = int.from_bytes(hashlib.blake2b(f"{rid}:{key}".encode(), digest_size=4).digest(), "little")
    if eos is not None and eos_every and h % eos_every == 0:
        return eos
    return 3 + h % 50


class CacheCorrupted(AssertionError):
    pass


@dataclass
class _State:
    tokens: list[int]
    num_computed: int
    table: list[int] | None
    digests: list[int] = field(default_factory=list)
    window_start: int = 0
    windows: list[list[int]] = field(default_factory=list)  # per window group: blocks of positions from window_start

    def digest(self, p: int) -> int:
        while len(self.digests) <= p:
            i = len(self.digests)
            self.digests.append(hash((self.digests[i - 1] if i else 0, self.tokens[i])))
        return self.digests[p]


class ModelExecutor:
    def __init__(self, num_device: int, num_cpu: int, block_size: int, eos: int | None = None,
                 eos_every: int = 0, window_groups: int = 0, window: int = 0, window_ring: bool = False,
                 window_only: bool = False) -> None:
        self.bs = block_size
        self.first_group = 1 if window_only else 0  # group 0: the full-attention layers' block table
        self.window_groups = window_groups
        self.window = window
        self.ring_size = ring_blocks(window, block_size) if window_ring else 0
        self.device: list[Slot] = [None] * (num_device * block_size)
        self.cpu: list[Slot] = [None] * (num_cpu * block_size)
        self.states: dict[str, _State] = {}
        self._holders: Counter[int] = Counter()
        self.cpu_owner: dict[int, str] = {}
        self.eos = eos
        self.eos_every = eos_every

    def _move(self, src: list[Slot], dst: list[Slot], mapping: list[tuple[int, int]]) -> None:
        snapshot = {a: src[a * self.bs:(a + 1) * self.bs] for a, _ in mapping}
        for a, b in mapping:
            dst[b * self.bs:(b + 1) * self.bs] = snapshot[a]

    def step(self, out: SchedulerOutput) -> ExecutorResult:
        for rid in out.finished_ids:
            self.states.pop(rid, None)
            self._release_swap_blocks(rid)
        if {b for _, b in out.swap_out} & {a for a, _ in out.swap_in} or \
                {a for a, _ in out.swap_out} & {b for _, b in out.swap_in}:
            raise CacheCorrupted("a swap-in and a swap-out of one step touch the same block")
        self._claim_swap_blocks(out)
        self._move(self.device, self.cpu, out.swap_out)
        for rid in out.swapped_out_ids:
            self.states[rid].table = None
            self.states[rid].windows = []
        self._move(self.cpu, self.device, out.swap_in)
        held = {b for st in self.states.values() if st.table is not None for b in st.table}
        for a, _ in out.copy:  # as the real executor's validator: a copy reads a block a live request holds
            if a not in held:
                raise CacheCorrupted(f"copy from block {a}, which no live request holds yet")
        self._move(self.device, self.device, out.copy)
        for n in out.new_requests():
            if self.first_group and n.block_ids:
                raise CacheCorrupted(f"{n.request_id}: a block table sent to a window-only model")
            self.states[n.request_id] = _State(list(n.token_ids), n.num_computed_tokens, list(n.block_ids))
            self._take_windows(n.request_id, out, whole=True)
        for r in out.running_requests():
            if self.first_group and r.new_block_ids:
                raise CacheCorrupted(f"{r.request_id}: block table blocks sent to a window-only model")
            st = self.states[r.request_id]
            if r.resumed:
                st.table = list(r.new_block_ids)
            else:
                if st.table is None:
                    raise CacheCorrupted(f"{r.request_id} scheduled while swapped out")
                st.table.extend(r.new_block_ids)
            self._take_windows(r.request_id, out, whole=r.resumed)
        self._holders = Counter(b for st in self.states.values() for b in self._blocks_of(st))
        sampled: dict[str, list[int]] = {}
        for work in out.scheduled:
            rid = work.request.request_id
            tokens = self._forward(rid, work.num_tokens, out.num_steps, work.draft_token_ids)
            if tokens:
                sampled[rid] = tokens
        for work in out.scheduled:
            self._drop_out_of_window(self.states.get(work.request.request_id))
        return answer(sampled, reverse=out.step_id % 2 == 1)

    def _take_windows(self, rid: str, out: SchedulerOutput, whole: bool) -> None:
        if not self.window_groups:
            return
        st, news = self.states[rid], out.window.get(rid)
        if whole:
            if news is None or len(news.groups) != self.window_groups:
                raise CacheCorrupted(f"{rid}: new or resumed without its {self.window_groups} window tables")
            st.window_start, st.windows = news.start, [list(g) for g in news.groups]
        elif news is not None:
            for group, new in zip(st.windows, news.groups, strict=True):
                group.extend(new)

    def _drop_out_of_window(self, st: _State | None) -> None:
        """The executor's own rule: window blocks before the next query's window are dropped after a step."""
        if st is None or not st.windows or self.ring_size:
            return
        cut = min(max(0, st.num_computed - self.window + 1) // self.bs - st.window_start, len(st.windows[0]))
        if cut > 0:
            for group in st.windows:
                del group[:cut]
            st.window_start += cut

    @staticmethod
    def _blocks_of(st: _State) -> set[int]:
        return set(st.table or ()) | {b for group in st.windows for b in group}

    def held_blocks(self) -> set[int]:
        """Every device block some request's tables name: the scheduler must hold each (none released)."""
        return {b for st in self.states.values() for b in self._blocks_of(st)}

    def _claim_swap_blocks(self, out: SchedulerOutput) -> None:
        """Swap blocks belong to the request swapped into them until a swap-in reads them or it is
        dropped, as in the real executor; a swap-out into a block still owned is corruption."""
        for _, b in out.swap_out:
            if b in self.cpu_owner:
                raise CacheCorrupted(f"swap-out into swap block {b}, still held by {self.cpu_owner[b]}")
        mappings = iter(out.swap_out)
        for rid in out.swapped_out_ids:
            st = self.states[rid]
            for _ in range(len(st.table or ()) + sum(map(len, st.windows))):
                self.cpu_owner[next(mappings)[1]] = rid
        for a, _ in out.swap_in:
            if self.cpu_owner.pop(a, None) is None:
                raise CacheCorrupted(f"swap-in from swap block {a}, which holds no swapped request")

    def _release_swap_blocks(self, rid: str) -> None:
        for b in [b for b, owner in self.cpu_owner.items() if owner == rid]:
            del self.cpu_owner[b]

    def _slot(self, st: _State, p: int, group: int = 0) -> int:
        assert st.table is not None
        table, index = st.table, p // self.bs
        if group:
            table, index = st.windows[group - 1], index - st.window_start
            if self.ring_size:
                if len(table) > self.ring_size:
                    raise CacheCorrupted(f"window group {group}: a ring of {len(table)} blocks, over {self.ring_size}")
                index = (p // self.bs) % self.ring_size
            elif index < 0:
                raise CacheCorrupted(f"window group {group} reads position {p}, whose block it released")
        if index >= len(table):
            raise CacheCorrupted(f"position {p} beyond block table of {len(table)} blocks (group {group})")
        return table[index] * self.bs + p % self.bs

    def _check_read(self, rid: str, st: _State, first_query: int) -> None:
        """The positions the step's queries read hold what computing them would write: all of them for the
        full-attention layers, those of the first query's window for the window groups."""
        reads = [(0, p) for p in range(first_query)] if not self.first_group else []
        for g in range(1, self.window_groups + 1):
            reads += [(g, p) for p in range(max(0, first_query - self.window + 1), first_query)]
        for g, p in reads:
            slot = self._slot(st, p, g)
            if self.device[slot] != (g, p, st.digest(p)):
                raise CacheCorrupted(f"{rid}: group {g}'s slot for position {p} holds {self.device[slot]}, "
                                     "not what computing it would write")

    def _write(self, rid: str, st: _State, p: int, digest: int) -> None:
        for g in range(self.first_group, self.window_groups + 1):
            slot = self._slot(st, p, g)
            if self._holders[slot // self.bs] != 1:
                raise CacheCorrupted(f"{rid} writes block {slot // self.bs}, which another live request holds")
            self.device[slot] = (g, p, digest)

    def _forward(self, rid: str, n: int, num_steps: int, drafts: tuple[int, ...] = ()) -> list[int]:
        st = self.states[rid]
        if drafts and (num_steps != 1 or st.num_computed + n != len(st.tokens)):
            raise CacheCorrupted(f"{rid}: drafts on a step that does not sample once after its last token")
        sampled: list[int] = []
        for _ in range(num_steps):
            self._check_read(rid, st, st.num_computed)
            for p in range(st.num_computed, st.num_computed + n):
                self._write(rid, st, p, st.digest(p))
            st.num_computed += n
            if st.num_computed < len(st.tokens):
                return sampled
            if drafts:
                return self._verify(rid, st, drafts)
            t = token_at(rid, len(st.tokens), self.eos, self.eos_every)
            st.tokens.append(t)
            sampled.append(t)
            n = 1
        return sampled


    def _verify(self, rid: str, st: _State, drafts: tuple[int, ...]) -> list[int]:
        """Compute the drafts' slots (each digest chained over the drafts before it), then keep the drafts while
        they equal the model's tokens, and the model's token after them."""
        known = len(st.tokens)
        digest = st.digest(known - 1)
        for j, token in enumerate(drafts):
            digest = hash((digest, token))
            self._write(rid, st, known + j, digest)
        run: list[int] = []
        while not run or (len(run) <= len(drafts) and run[-1] == drafts[len(run) - 1]):
            run.append(token_at(rid, known + len(run), self.eos, self.eos_every))
        st.tokens += run
        st.num_computed += len(run) - 1
        return run


def answer(sampled: dict[str, list[int]], reverse: bool) -> ExecutorResult:
    """A step's answer as the executor client builds it from the wire: columns when every request
    sampled one token, else token lists; in the step's order or (reverse) not, as the contract allows."""
    if any(len(tokens) != 1 for tokens in sampled.values()):
        return ExecutorResult(sampled=sampled)
    ids = list(sampled)[::-1] if reverse else list(sampled)
    return ExecutorResult(ids=ids, tokens=[sampled[rid][0] for rid in ids])
