"""An in-process executor model for core tests: it keeps a fake KV cache whose every slot records
(position, digest of the tokens up to it) -- what a real model's KV at that slot depends on. Before
each forward it checks that a request's computed positions hold exactly what computing them itself
would have written (so a shared or cached block must equal a recompute), and that every block it
writes is held by no other live request (a shared block is copied first). It applies swap and copy
mappings the way a real executor must. Draft tokens (speculative decoding) are computed into their slots
like any token and verified against the model's tokens: a rejected draft leaves a slot whose record names
tokens the request never had, so any later read of it is caught as corruption."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput

Slot = tuple[int, int] | None


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

    def digest(self, p: int) -> int:
        while len(self.digests) <= p:
            i = len(self.digests)
            self.digests.append(hash((self.digests[i - 1] if i else 0, self.tokens[i])))
        return self.digests[p]


class ModelExecutor:
    def __init__(self, num_device: int, num_cpu: int, block_size: int, eos: int | None = None,
                 eos_every: int = 0) -> None:
        self.bs = block_size
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
        self._move(self.cpu, self.device, out.swap_in)
        held = {b for st in self.states.values() if st.table is not None for b in st.table}
        for a, _ in out.copy:  # as the real executor's validator: a copy reads a block a live request holds
            if a not in held:
                raise CacheCorrupted(f"copy from block {a}, which no live request holds yet")
        self._move(self.device, self.device, out.copy)
        for n in out.new_requests():
            self.states[n.request_id] = _State(list(n.token_ids), n.num_computed_tokens, list(n.block_ids))
        for r in out.running_requests():
            st = self.states[r.request_id]
            if r.resumed:
                st.table = list(r.new_block_ids)
            else:
                if st.table is None:
                    raise CacheCorrupted(f"{r.request_id} scheduled while swapped out")
                st.table.extend(r.new_block_ids)
        self._holders = Counter(b for st in self.states.values() if st.table is not None for b in set(st.table))
        sampled: dict[str, list[int]] = {}
        for work in out.scheduled:
            rid = work.request.request_id
            tokens = self._forward(rid, work.num_tokens, out.num_steps, work.draft_token_ids)
            if tokens:
                sampled[rid] = tokens
        return answer(sampled, reverse=out.step_id % 2 == 1)

    def _claim_swap_blocks(self, out: SchedulerOutput) -> None:
        """Swap blocks belong to the request swapped into them until a swap-in reads them or it is
        dropped, as in the real executor; a swap-out into a block still owned is corruption."""
        for _, b in out.swap_out:
            if b in self.cpu_owner:
                raise CacheCorrupted(f"swap-out into swap block {b}, still held by {self.cpu_owner[b]}")
        mappings = iter(out.swap_out)
        for rid in out.swapped_out_ids:
            for _ in self.states[rid].table or ():
                self.cpu_owner[next(mappings)[1]] = rid
        for a, _ in out.swap_in:
            if self.cpu_owner.pop(a, None) is None:
                raise CacheCorrupted(f"swap-in from swap block {a}, which holds no swapped request")

    def _release_swap_blocks(self, rid: str) -> None:
        for b in [b for b, owner in self.cpu_owner.items() if owner == rid]:
            del self.cpu_owner[b]

    def _slot(self, st: _State, p: int) -> int:
        assert st.table is not None
        if p // self.bs >= len(st.table):
            raise CacheCorrupted(f"position {p} beyond block table of {len(st.table)} blocks")
        return st.table[p // self.bs] * self.bs + p % self.bs

    def _forward(self, rid: str, n: int, num_steps: int, drafts: tuple[int, ...] = ()) -> list[int]:
        st = self.states[rid]
        if drafts and (num_steps != 1 or st.num_computed + n != len(st.tokens)):
            raise CacheCorrupted(f"{rid}: drafts on a step that does not sample once after its last token")
        sampled: list[int] = []
        for _ in range(num_steps):
            for p in range(st.num_computed):
                if self.device[self._slot(st, p)] != (p, st.digest(p)):
                    raise CacheCorrupted(f"{rid}: slot for position {p} holds {self.device[self._slot(st, p)]}, "
                                         "not what computing it would write")
            for p in range(st.num_computed, st.num_computed + n):
                slot = self._slot(st, p)
                if self._holders[slot // self.bs] != 1:
                    raise CacheCorrupted(f"{rid} writes block {slot // self.bs}, which another live request holds")
                self.device[slot] = (p, st.digest(p))
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
            slot = self._slot(st, known + j)
            if self._holders[slot // self.bs] != 1:
                raise CacheCorrupted(f"{rid} writes a draft into block {slot // self.bs}, which another request holds")
            self.device[slot] = (known + j, digest)
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
