"""Work served round-robin across the callers that queued it, each caller's in arrival order."""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """An owner that queued many items delays another owner's next item by at most the one of its own being
    served: the owner just served goes behind every owner waiting, including those that arrive while its
    item runs."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[str, deque[T]] = OrderedDict()
        self._served: tuple[str, deque[T]] | None = None

    def push(self, owner: str, item: T) -> None:
        if self._served is not None and self._served[0] == owner:
            self._served[1].append(item)
        else:
            self._waiting.setdefault(owner, deque()).append(item)

    def pop(self) -> T | None:
        if self._served is not None and self._served[1]:
            self._waiting[self._served[0]] = self._served[1]
        self._served = None
        if not self._waiting:
            return None
        owner, items = self._waiting.popitem(last=False)
        self._served = (owner, items)
        return items.popleft()

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values())) + (len(self._served[1]) if self._served else 0)
