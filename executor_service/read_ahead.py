"""The Execute stream's next message read while the current step runs (#29).

Under async scheduling the scheduler has written the next step before the executor finishes the current one, but
grpc.aio only reads a message when asked: its read op then goes through gRPC's poller and back to the event loop,
~0.2 - 0.5 ms a step on a busy 2-core box, with the executor idle. ReadAhead keeps one read in flight while a step
runs, so the next step is in hand when it ends. Messages come out in order, each once; a read the stream's end
leaves unfinished is cancelled with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

T = TypeVar("T")


class ReadAhead(Generic[T]):
    """next() answers the stream's messages in order (StopAsyncIteration at its end); ahead() starts reading the
    one after, to be answered by the next call of next()."""

    def __init__(self, messages: AsyncIterator[T]) -> None:
        self._messages = messages
        self._pending: asyncio.Future[T] | None = None
        self._failed: Exception | None = None
        """The error a read raised (a message that does not parse): every later next() raises it too, where the
        stream's iterator, closed by it, would answer StopAsyncIteration, as if the peer had half-closed."""

    async def next(self) -> T:
        if self._failed is not None:
            raise self._failed
        pending, self._pending = self._pending, None
        try:
            return await (self._messages.__anext__() if pending is None else pending)
        except StopAsyncIteration:
            raise
        except Exception as e:
            self._failed = e
            raise

    def ahead(self) -> None:
        """Start reading the next message now (no-op while a read is in flight or after a failed one)."""
        if self._pending is None and self._failed is None:
            self._pending = asyncio.ensure_future(self._messages.__anext__())

    def close(self) -> None:
        """Cancel a read still in flight (the stream is ending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.done() and not pending.cancelled():
            pending.exception()  # retrieved: the stream's end (or its error) needs no answer
        pending.cancel()
