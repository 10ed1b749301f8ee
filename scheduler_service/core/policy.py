"""Waiting-queue order: fcfs, sjf and priority, with aging and a max-wait guard.

Effective priority under aging is base - aging_rate * (now - arrival). Its order does not
change with `now`, so a heap keyed by base + aging_rate * arrival serves it in O(log n). Ties go by
arrival (a request preempted for recompute re-enters ahead of later arrivals of equal key).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import deque

from scheduler_service.core.request import Request, RequestStatus


class Policy(enum.Enum):
    FCFS = "fcfs"
    SJF = "sjf"
    PRIORITY = "priority"


def sort_key(policy: Policy, request: Request, aging_rate: float) -> float:
    if policy is Policy.FCFS:
        return request.arrival_time
    base = request.sampling.priority if policy is Policy.PRIORITY else request.remaining_output
    return base + aging_rate * request.arrival_time


class WaitingQueue:
    def __init__(self, policy: Policy, aging_rate: float = 0.0, max_waiting_time: float | None = None) -> None:
        self.policy = policy
        self.aging_rate = aging_rate
        self.max_waiting_time = max_waiting_time
        self._fifo: deque[tuple[int, Request]] = deque()
        self._heap: list[tuple[float, float, int, int, Request]] = []
        self._by_arrival: list[tuple[float, int, int, Request]] = []
        self._tiebreak = itertools.count()
        self._versions: dict[str, int] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _is_live(self, version: int, request: Request) -> bool:
        return request.status is RequestStatus.WAITING and self._versions.get(request.request_id) == version

    def push(self, request: Request, front: bool = False) -> None:
        request.status = RequestStatus.WAITING
        version = next(self._tiebreak)
        self._versions[request.request_id] = version
        self._len += 1
        n = next(self._tiebreak)
        heapq.heappush(self._by_arrival, (request.arrival_time, n, version, request))
        if self.policy is Policy.FCFS:
            (self._fifo.appendleft if front else self._fifo.append)((version, request))
        else:
            key = sort_key(self.policy, request, self.aging_rate)
            heapq.heappush(self._heap, (key, request.arrival_time, n, version, request))

    def discard(self, request: Request) -> None:
        """Forget a request that leaves WAITING (admitted or aborted); its entries go stale."""
        del self._versions[request.request_id]
        self._len -= 1

    def oldest(self) -> Request | None:
        heap = self._by_arrival
        while heap and not self._is_live(heap[0][2], heap[0][3]):
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def peek(self, now: float) -> Request | None:
        oldest = self.oldest()
        if oldest is not None and self.max_waiting_time is not None \
                and now - oldest.arrival_time > self.max_waiting_time:
            return oldest
        if self.policy is Policy.FCFS:
            fifo = self._fifo
            while fifo and not self._is_live(*fifo[0]):
                fifo.popleft()
            return fifo[0][1] if fifo else None
        heap = self._heap
        while heap and not self._is_live(heap[0][3], heap[0][4]):
            heapq.heappop(heap)
        return heap[0][4] if heap else None
