"""The step's plain decodes as rows of the running set's NumPy columns: chosen with one mask, grown in one
pool call, cut by the token budget and by preemption, handed to the executor as PlainRows, and updated as
columns.

A plain decode is a running request with one token to compute (and, under async scheduling, only plain
decodes in flight before it) that surely goes on past it: it needs nothing but a place in the token
budget and, when it fills its blocks, one more block. This module is the data handling of that fast
path; the scheduler (scheduler.py) walks the running order, charges the budget and preempts, and the
stop table (stop_rules.py) says which updated rows must walk through the per-request rules.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import compress, repeat

import numpy as np

from scheduler_service.core.kv_cache_manager import KVCacheManager
from scheduler_service.core.outputs import ExecutorResult, PlainRows, ScheduledWork
from scheduler_service.core.request import Request, RequestStatus
from scheduler_service.core.running import EMPTY, Order, RunningSet

Grow = Callable[[Request, int, int], list[int] | None]
"""The scheduler's way to grow one request's table by n tokens and extra slots (None: the pool is short)."""


class PlainDecodes:
    """One step's plain decodes while schedule() runs: the running-order snapshot they were chosen from,
    the chosen mask over it, the works of the rows grown this step (by position) and how far the walk of
    the running order has charged the token budget."""

    __slots__ = ("chosen", "grown", "order", "taken")

    def __init__(self, order: Order, chosen: np.ndarray) -> None:
        self.order = order
        self.chosen = chosen
        self.grown: dict[int, ScheduledWork] = {}
        self.taken = 0  # the chosen rows before this position have taken their token from the budget

    @classmethod
    def choose(cls, rs: RunningSet, kv: KVCacheManager, grow: Grow, num_steps: int, extra: int) -> PlainDecodes:
        """The plain decodes of the running order (with num_steps > 1, none with a step in flight), their
        tables holding the step's slots plus `extra`: those whose tables hold them already are chosen, and
        those that fill theirs get their blocks (see _grow)."""
        order = rs.order
        slots = order.slots
        ahead = rs.inflight[slots]
        total = rs.num_tokens[slots] + ahead  # its tokens once the steps in flight are done
        decode = (rs.uncomputed[slots] == 1) & (total < rs.limit[slots]) & ~rs.drafting[slots]
        if num_steps > 1:
            decode &= ahead == 0
        need = total + extra
        plain = cls(order, decode & (need <= rs.capacity[slots]))
        short = decode & ~plain.chosen
        if short.any():
            plain._grow(rs, kv, grow, short, need)
        return plain

    def _grow(self, rs: RunningSet, kv: KVCacheManager, grow: Grow, short: np.ndarray, need: np.ndarray) -> None:
        """Blocks for plain decodes that fill theirs: all at once when the pool has them, else in running
        order while it does (the rest take the scheduler's per-request path, which may preempt, or finish
        one that would outgrow the usable pool)."""
        order = self.order
        bs = kv.block_size
        positions = np.flatnonzero(short & (need <= kv.usable_slots))  # the others are rejected as outgrown
        if not len(positions):
            return
        slots = order.slots[positions]
        missing = -(-need[positions] // bs) - rs.capacity[slots] // bs
        requests = [order.requests[p] for p in positions.tolist()]
        grown = kv.grow_tables(requests, missing.tolist())
        if grown is not None:
            if kv.window_only:  # a ring that fills covers every position from then on
                rs.capacity[slots] = [kv.num_slots(r.request_id) for r in requests]
            else:
                rs.capacity[slots] += missing * bs
            self.chosen[positions] = True
            works = map(ScheduledWork, requests, repeat(1), grown)
            self.grown.update(zip(positions.tolist(), works, strict=True))
            return
        for p in positions.tolist():
            request = order.requests[p]
            new = grow(request, int(need[p]) - request.num_computed_tokens, 0)
            if new is None:
                return
            self.chosen[p] = True
            self.grown[p] = ScheduledWork(request, 1, new)

    def unchosen(self) -> list[int]:
        """The positions the per-request path takes, in running order."""
        return np.flatnonzero(~self.chosen).tolist()

    def take(self, start: int, end: int, tokens_left: int) -> int:
        """The chosen plain decodes in [start, end) take a token each; the budget's end unchooses the rest."""
        run = self.chosen[start:end]
        count = int(np.count_nonzero(run))
        if count <= tokens_left:
            return tokens_left - count
        self.chosen[start + int(np.flatnonzero(run)[tokens_left]):] = False
        return 0

    def count(self) -> int:
        return int(np.count_nonzero(self.chosen))

    def ungrow_unchosen(self, rs: RunningSet, kv: KVCacheManager) -> None:
        """A grown decode the budget left out gives its new blocks back (the executor never hears of them)."""
        chosen = self.chosen
        for p, work in self.grown.items():
            request = work.request
            if not chosen[p] and request.status is RequestStatus.RUNNING:
                kv.release_tail(request.request_id, len(work.new_block_ids))
                rs.set_capacity(request, kv.num_slots(request.request_id))

    def unchoose(self, request: Request, kv: KVCacheManager) -> bool:
        """Take a request out of this step's plain decodes, giving back a block it grew by this step;
        True if it was one of them and its token already came out of the budget (a row the walk of the
        running order has not reached yet takes its token only then)."""
        order = self.order
        for pos in np.flatnonzero(order.slots == request.slot).tolist():
            if order.requests[pos] is request and self.chosen[pos]:
                self.chosen[pos] = False
                grown = self.grown.pop(pos, None)
                if grown is not None:
                    kv.release_tail(request.request_id, len(grown.new_block_ids))
                return pos < self.taken
        return False

    def rows(self, rs: RunningSet) -> PlainRows:
        """The chosen rows, which lead the step's scheduled works."""
        order, chosen = self.order, self.chosen
        works = order.works
        if self.grown:
            works = works.copy()
            for p, work in self.grown.items():
                works[p] = work
        if chosen.all():
            return PlainRows(order.slots, rs.gen[order.slots], order.ids, order.outputs, order.requests, works)
        keep = chosen.tolist()
        slots = order.slots[chosen]
        return PlainRows(slots, rs.gen[slots], list(compress(order.ids, keep)), list(compress(order.outputs, keep)),
                         list(compress(order.requests, keep)), list(compress(works, keep)))


NO_PLAIN = PlainDecodes(EMPTY, np.zeros(0, np.bool_))
"""Between steps: no plain decodes to unchoose."""


def count_in_flight(rs: RunningSet, plain: PlainRows | None, change: int) -> None:
    """Async scheduling: a step's plain decodes whose rows still hold them have `change` more steps in flight."""
    if plain is not None and len(plain.slots):
        alive = plain.slots[rs.gen[plain.slots] == plain.gens]
        rs.inflight[alive] += change


def plain_tokens(plain: PlainRows, result: ExecutorResult) -> list[int] | None:
    """The one token each plain decode sampled, aligned with plain.ids; None when the answer says more
    than that (errors, logprobs, several tokens, one missing)."""
    if result.errors or result.logprobs or result.prompt_logprobs:
        return None
    ids = plain.ids
    if result.ids:
        if result.ids[:len(ids)] == ids:
            return result.tokens[:len(ids)]
        found: list[int | None] = list(map(result.token_index().get, ids))
    else:
        lists = list(map(result.sampled.get, ids))
        if any(tokens is None or len(tokens) != 1 for tokens in lists):
            return None
        return [tokens[0] for tokens in lists]  # type: ignore[index]
    return None if None in found else found  # type: ignore[return-value]


def append_tokens(rs: RunningSet, plain: PlainRows,
                  tokens: list[int]) -> tuple[list[Request], list[str], list[int], np.ndarray]:
    """Each plain decode still in its row (not finished or preempted since) appends its token, and its
    token count grows by one. Returns those rows' requests, ids and tokens, and the mask of the ones the
    stop table says must walk through the per-request rules."""
    slots, requests, ids, outputs = plain.slots, plain.requests, plain.ids, plain.outputs
    alive = rs.gen[slots] == plain.gens
    if not alive.all():
        keep = alive.tolist()
        slots = slots[alive]
        requests, ids = list(compress(requests, keep)), list(compress(ids, keep))
        outputs, tokens = list(compress(outputs, keep)), list(compress(tokens, keep))
    deque(map(list.append, outputs, tokens), maxlen=0)
    num_tokens = rs.num_tokens[slots] + 1
    rs.num_tokens[slots] = num_tokens
    return requests, ids, tokens, rs.may_stop(slots, num_tokens, tokens)
