"""The engine core frees a request as soon as it ends (#27): its sink (the queue the ExecutorLoop routes its deltas
to) and its RequestStream referred to each other, so every finished request waited for a full collection of the
garbage collector, which the engine core runs rarely (its thresholds are raised): the memory soak saw ~30% of
the requests of each minute still held, the engine core's RSS climbing between collections. Whatever way a
request ends here, nothing of it is left once the pool lets go, with the collector off."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.engine.engine_core import EngineCore, FrontendLink
from scheduler_service.engine.executor_loop import RequestStream
from scheduler_service.messages import Ended, NewRequest, ToCore, ipc_address


class FakePool:
    """Holds each request's stream while it runs, as an ExecutorLoop does, and lets go when it ends."""

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}
        self.metrics = None

    def add(self, request: Request, queue: asyncio.Queue[RequestDelta], stop_strings: bool = False) -> RequestStream:
        stream = self.streams[request.request_id] = RequestStream(request, queue, stop_strings=stop_strings)
        return stream

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        self.streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def end_in_core(self, request_id: str, reason: FinishReason) -> None:
        """The core finished it (a stop token, max_tokens): the final delta goes out, the stream is dropped."""
        stream = self.streams.pop(request_id)
        stream.queue.put_nowait(RequestDelta(request_id, [7], reason))


def alive() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, Request | RequestStream))


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def new(rid: str, stop_strings: bool = False) -> NewRequest:
    return NewRequest(rid, [1, 2, 3], SamplingOptions(max_tokens=4), 0.0, stop_strings=stop_strings)


async def test_a_request_is_freed_however_it_ends(collector_off: None) -> None:
    pool = FakePool()
    core = EngineCore(pool, ipc_address("test-memory"))  # type: ignore[arg-type]
    core._send = lambda link, msg: None  # type: ignore[method-assign]
    link = FrontendLink(b"api-0-0", core)
    before = alive()
    core._take(link, ToCore(new=[new("stop"), new("length-stop-strings", True), new("ended"), new("aborted"),
                                 new("orphan")]))
    assert len(pool.streams) == 5 and alive() == before + 10
    pool.end_in_core("stop", FinishReason.STOPPED)  # a final delta
    pool.end_in_core("length-stop-strings", FinishReason.LENGTH)  # final, but the api server settles it
    core._take(link, ToCore(ended=[Ended("length-stop-strings", FinishReason.STOPPED),
                                   Ended("ended", FinishReason.STOPPED), Ended("aborted", FinishReason.ABORTED)]))
    core.links[link.identity] = link
    assert core.drop_frontend(link.identity) == 1  # its api server died: "orphan" is aborted
    await asyncio.sleep(0)  # the step's flush
    assert not pool.streams and not link.sinks
    assert alive() == before, "a finished request is still held (a reference cycle waits for the collector)"
