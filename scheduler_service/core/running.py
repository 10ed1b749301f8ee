"""The running requests in running order, with NumPy columns for what every step reads of each.

Rows are slots: a request keeps its slot while it runs, so a step scheduled before a request finished
(or before another took its slot) still finds the right rows; `gen` tells a reused slot apart. The
ordered lists are replaced, never changed in place, so a step may keep the ones it was built from.
The stop columns (`limit`, `watch`, `listen`) are derived from the stop-rule table (stop_rules.py),
which also reads them back in the vectorised check of the plain decodes (decode_rows.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from scheduler_service.core.kv_cache_manager import NO_BLOCKS
from scheduler_service.core.outputs import ScheduledWork
from scheduler_service.core.request import Request
from scheduler_service.core.stop_rules import NO_PLAN, Plans, StopTable


@dataclass(slots=True, frozen=True)
class Order:
    """One snapshot of the running order: slot numbers and each row's request, id, output list and
    plain decode work (one token, no new blocks), all aligned."""

    slots: np.ndarray
    requests: list[Request]
    ids: list[str]
    outputs: list[list[int]]
    works: list[ScheduledWork]


EMPTY = Order(np.zeros(0, np.int64), [], [], [], [])
NO_PLANS: Plans = (NO_PLAN, NO_PLAN)


class RunningSet:
    """Columns per row: known tokens, tokens not yet computed, table capacity in slots, steps in flight
    (async scheduling), drafting (draft tokens proposed for this step, or a step with drafts in flight: not a
    plain decode), the slot's generation, and the stop columns of the table `stops`: `limit` (tokens
    at which a length rule surely ends the request), `watch` (a plain decode must walk through update()'s
    per-request rules: a general rule may end it, or it has sampled nothing yet, and its prompt's last
    block is registered in the prefix cache when that token is computed) and `listen` (one column per
    token rule with ids: the request stops on them)."""

    def __init__(self, stops: StopTable, capacity: int = 64) -> None:
        self.stops = stops
        self.num_tokens = np.zeros(capacity, np.int64)
        self.uncomputed = np.zeros(capacity, np.int64)
        self.capacity = np.zeros(capacity, np.int64)
        self.limit = np.zeros(capacity, np.int64)
        self.watch = np.zeros(capacity, np.bool_)
        self.listen = [np.zeros(capacity, np.bool_) for _ in stops.token_sets]
        self._rules_watch = np.zeros(capacity, np.bool_)  # the rules' part of `watch` (fixed per request)
        self.plans: list[Plans] = [NO_PLANS] * capacity  # each row's stop plans (StopTable.row)
        self.gen = np.zeros(capacity, np.int64)
        self.inflight = np.zeros(capacity, np.int64)
        self.drafting = np.zeros(capacity, np.bool_)
        self._free_slots = list(range(capacity - 1, -1, -1))
        self.order = EMPTY

    def __len__(self) -> int:
        return len(self.order.requests)

    def __bool__(self) -> bool:
        return bool(self.order.requests)

    @property
    def requests(self) -> list[Request]:
        return self.order.requests

    def add(self, request: Request, num_slots: int) -> None:
        """A request enters RUNNING (last in the running order) holding num_slots token slots."""
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        request.slot = slot
        self.num_tokens[slot] = request.num_tokens
        self.uncomputed[slot] = request.num_uncomputed_tokens
        self.capacity[slot] = num_slots
        self.plans[slot], self.limit[slot], watch, listens = self.stops.row(request.sampling, request.num_prompt_tokens)
        self._rules_watch[slot] = watch
        self.watch[slot] = watch or not request.output_token_ids
        for column, listening in zip(self.listen, listens, strict=True):
            column[slot] = listening
        self.inflight[slot] = 0
        self.drafting[slot] = False
        work = ScheduledWork(request, 1, NO_BLOCKS)
        o = self.order
        self.order = Order(np.append(o.slots, slot), [*o.requests, request], [*o.ids, request.request_id],
                           [*o.outputs, request.output_token_ids], [*o.works, work])

    def remove(self, request: Request) -> None:
        o = self.order
        i = o.requests.index(request)
        self.order = Order(np.delete(o.slots, i), o.requests[:i] + o.requests[i + 1:], o.ids[:i] + o.ids[i + 1:],
                           o.outputs[:i] + o.outputs[i + 1:], o.works[:i] + o.works[i + 1:])
        self._free(request)

    def clear(self) -> None:
        for request in self.order.requests:
            self._free(request)
        self.order = EMPTY

    def _free(self, request: Request) -> None:
        self.gen[request.slot] += 1
        self._free_slots.append(request.slot)
        request.slot = -1

    def sync(self, request: Request) -> None:
        """Copy a running request's token counts into its row (after the scheduler changed them)."""
        slot = request.slot
        self.num_tokens[slot] = request.num_tokens
        self.uncomputed[slot] = request.num_uncomputed_tokens
        self.watch[slot] = self._rules_watch[slot] or not request.output_token_ids

    def set_capacity(self, request: Request, num_slots: int) -> None:
        self.capacity[request.slot] = num_slots

    def may_stop(self, slots: np.ndarray, num_tokens: np.ndarray, tokens: list[int]) -> np.ndarray:
        """The stop table's vectorised check over these rows' stop columns (StopTable.may_stop)."""
        return self.stops.may_stop(slots, num_tokens, tokens, self.limit, self.watch, self.listen)

    def _grow(self) -> None:
        old = len(self.num_tokens)
        (self.num_tokens, self.uncomputed, self.capacity, self.limit, self.watch, self._rules_watch, self.gen,
         self.inflight, self.drafting, *self.listen) = (np.concatenate([c, np.zeros_like(c)]) for c in (
            self.num_tokens, self.uncomputed, self.capacity, self.limit, self.watch, self._rules_watch, self.gen,
            self.inflight, self.drafting, *self.listen))
        self.plans += [NO_PLANS] * old
        self._free_slots.extend(range(2 * old - 1, old - 1, -1))
