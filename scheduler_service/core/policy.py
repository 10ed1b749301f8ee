"""Waiting-queue order: fcfs, sjf and priority, with aging and a max-wait guard, taking turns between owners.

Effective priority under aging is base - aging_rate * (now - arrival). Its order does not
change with `now`, so a heap keyed by base + aging_rate * arrival serves it in O(log n). Ties go by
arrival (a request preempted for recompute re-enters ahead of later arrivals of equal key).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections import OrderedDict, deque
from dataclasses import dataclass, field

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


@dataclass(slots=True)
class Lane:
    """One owner's waiting requests in the policy's order (a FIFO or a heap), and how many are live."""

    fifo: deque[tuple[int, Request]] = field(default_factory=deque)
    heap: list[tuple[float, float, int, int, Request]] = field(default_factory=list)
    live: int = 0


class WaitingQueue:
    """Waiting requests in the policy's order, taking turns between owners (API keys): each owner's requests
    wait in a lane of their own, and the owners whose lanes hold requests take turns, the owner of each admitted
    request going behind the others (also behind those whose first request arrives before the next admission).
    One owner's flood so delays another owner's next request by at most one admission per owner waiting, and with
    a single owner (no API keys) the order is the policy's alone.

    fcfs: the next owner's oldest request; requests pushed to the front (preempted for recompute, an executor's
    loss) go before every lane, as they did before turns. sjf, priority: the best key among the owners' next
    requests; the turn decides only between owners whose next requests tie (equal priorities without aging), so
    a better priority is always admitted first. --max-waiting-time sends the oldest request, whoever's, first."""

    def __init__(self, policy: Policy, aging_rate: float = 0.0, max_waiting_time: float | None = None) -> None:
        self.policy = policy
        self.aging_rate = aging_rate
        self.max_waiting_time = max_waiting_time
        self._lanes: OrderedDict[str, Lane] = OrderedDict()  # owners with live requests, next turn first
        self._last_admitted: str | None = None  # stays behind owners that arrive before the next admission
        self._front: deque[tuple[int, Request]] = deque()
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
        lane = self._lanes.get(request.owner)
        if lane is None:
            lane = self._lanes[request.owner] = Lane()
            last = self._last_admitted
            if last is not None and last in self._lanes and last != request.owner:
                self._lanes.move_to_end(last)
        lane.live += 1
        n = next(self._tiebreak)
        heapq.heappush(self._by_arrival, (request.arrival_time, n, version, request))
        if self.policy is not Policy.FCFS:
            key = sort_key(self.policy, request, self.aging_rate)
            heapq.heappush(lane.heap, (key, request.arrival_time, n, version, request))
        elif front:
            self._front.appendleft((version, request))
        else:
            lane.fifo.append((version, request))

    def discard(self, request: Request, admitted: bool = False) -> None:
        """Forget a request that leaves WAITING (admitted or aborted); its entries go stale. An admitted request's
        owner goes behind the other owners waiting."""
        del self._versions[request.request_id]
        self._len -= 1
        lane = self._lanes[request.owner]
        lane.live -= 1
        if admitted:
            self._last_admitted = request.owner
        if lane.live == 0:
            del self._lanes[request.owner]
        elif admitted:
            self._lanes.move_to_end(request.owner)

    def owners_waiting(self) -> list[str]:
        """The owners with waiting requests, the next turn's first."""
        return list(self._lanes)

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
            return self._peek_fifo()
        return self._peek_heaps()

    def _peek_fifo(self) -> Request | None:
        front = self._front
        while front and not self._is_live(*front[0]):
            front.popleft()
        if front:
            return front[0][1]
        for lane in self._lanes.values():
            fifo = lane.fifo
            while fifo and not self._is_live(*fifo[0]):
                fifo.popleft()
            if fifo:
                return fifo[0][1]
        return None

    def _peek_heaps(self) -> Request | None:
        best: tuple[float, float, int, int, Request] | None = None
        for lane in self._lanes.values():
            heap = lane.heap
            while heap and not self._is_live(heap[0][3], heap[0][4]):
                heapq.heappop(heap)
            if heap and (best is None or heap[0][0] < best[0]):
                best = heap[0]
        return best[4] if best is not None else None
