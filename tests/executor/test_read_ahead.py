"""ReadAhead (executor_service/read_ahead.py): the Execute stream's next message read while a step runs, in order,
each once, the stream's end answered as StopAsyncIteration, a read in flight cancelled by close (#29)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from executor_service.read_ahead import ReadAhead


class Stream:
    """Messages 0..n-1, each released by the test (a gate per message), recording which were asked for."""

    def __init__(self, n: int) -> None:
        self.gates = [asyncio.Event() for _ in range(n)]
        self.asked = [asyncio.Event() for _ in range(n)]
        self.ended = asyncio.Event()

    async def messages(self) -> AsyncIterator[int]:
        for i, gate in enumerate(self.gates):
            self.asked[i].set()
            await gate.wait()
            yield i
        self.ended.set()


async def test_ahead_reads_the_next_message_before_it_is_asked_for_and_answers_in_order() -> None:
    stream = Stream(3)
    reader = ReadAhead(stream.messages())
    stream.gates[0].set()
    assert await reader.next() == 0
    reader.ahead()
    pending = reader._pending
    reader.ahead()  # one read in flight at a time
    assert reader._pending is pending
    await stream.asked[1].wait()  # message 1 is being read while "the step" runs, before next() asks
    assert not stream.asked[2].is_set()
    stream.gates[1].set()
    stream.gates[2].set()
    assert [await reader.next(), await reader.next()] == [1, 2]
    reader.ahead()
    with pytest.raises(StopAsyncIteration):
        await reader.next()


async def test_close_cancels_a_read_in_flight() -> None:
    stream = Stream(2)
    reader = ReadAhead(stream.messages())
    stream.gates[0].set()
    assert await reader.next() == 0
    reader.ahead()
    await stream.asked[1].wait()
    pending = reader._pending
    assert pending is not None and not pending.done()
    reader.close()
    await asyncio.wait({pending})
    assert pending.cancelled()


async def test_close_after_the_streams_end_was_read_ahead_leaves_nothing_unretrieved() -> None:
    stream = Stream(0)
    reader = ReadAhead(stream.messages())
    reader.ahead()
    pending = reader._pending
    assert pending is not None
    await asyncio.wait({pending})
    assert stream.ended.is_set() and isinstance(pending.exception(), StopAsyncIteration)
    reader.close()  # the StopAsyncIteration held by the read is retrieved, not logged as never retrieved
    assert reader._pending is None


async def test_a_read_that_failed_fails_every_later_read_not_ending_the_stream_as_if_half_closed() -> None:
    """A message that does not parse raises out of grpc's request iterator, which is then closed: its next read
    would answer StopAsyncIteration, a clean half-close. The masks of a token_bitmasks_follow step are read inside
    the step (whose error answers it); the stream must still end in that error, not OK."""

    async def messages() -> AsyncIterator[int]:
        yield 0
        raise ValueError("does not parse")

    reader = ReadAhead(messages())
    assert await reader.next() == 0
    reader.ahead()
    for _ in range(2):
        with pytest.raises(ValueError, match="does not parse"):
            await reader.next()
        reader.ahead()  # no read after a failed one
        assert reader._pending is None
