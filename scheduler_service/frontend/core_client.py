"""The engine core as a front-end process sees it: ExecutorLoop's add/abort/finish/describe/ready surface over
one ZeroMQ socket, with one batched message per event-loop turn toward the core."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import zmq
import zmq.asyncio

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.outputs import RequestDelta, TokenLogprob
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.generation import RequestError
from scheduler_service.messages import (
    Delta,
    Ended,
    NewRequest,
    Refusal,
    Refused,
    Status,
    ToCore,
    ToFrontend,
    encoder,
    new_request,
    settled_by_frontend,
    to_frontend_decoder,
)

log = logging.getLogger("pagedserve.frontend")
REFUSAL_CODES = {Refusal.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 Refusal.DUPLICATE_ID: grpc.StatusCode.ALREADY_EXISTS,
                 Refusal.NOT_READY: grpc.StatusCode.UNAVAILABLE}


@dataclass(slots=True)
class RemoteStream:
    """An api server's record of one sequence it added (what ExecutorLoop.add's RequestStream is in-process)."""

    queue: asyncio.Queue[Any]
    executor_unavailable: bool = False
    stop_strings: bool = False  # a LENGTH finish waits for finish() to settle it (ExecutorLoop.add)


class CoreClient:
    def __init__(self, address: str, identity: bytes, max_buffered: int) -> None:
        self.address = address
        self.metrics_model_name: str | None = None
        self.identity = identity
        self.max_buffered = max_buffered
        self.describe: executor_pb2.DescribeResponse | None = None
        self.ready = asyncio.Event()
        self.streams: dict[str, RemoteStream] = {}
        self._unsettled: set[str] = set()  # LENGTH finishes the core counts once finish() settles them
        self.on_ready_change: Callable[[bool], object] | None = None
        self.num_overflowed = 0
        self._unreported_overflows = 0
        self._unreported_refusals: dict[str, int] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._new: list[NewRequest] = []
        self._ended: list[Ended] = []
        self._flush_pending = False
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sock.connect(self.address)
        await self._sock.send(encoder.encode(ToCore(hello=True)))
        self._reader = asyncio.create_task(self._read(), name="core-reader")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._sock.close(linger=0)
        self._ctx.term()

    # ---- toward the core -------------------------------------------------------------------

    def add(self, request: Request, queue: asyncio.Queue[Any], stop_strings: bool = False) -> RemoteStream:
        if request.request_id in self.streams:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        stream = self.streams[request.request_id] = RemoteStream(queue, stop_strings=stop_strings)
        self._new.append(new_request(request, stop_strings))
        self._schedule_flush()
        return stream

    def abort(self, request_id: str) -> None:
        self.finish(request_id, FinishReason.ABORTED)

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        if self.streams.pop(request_id, None) is not None or request_id in self._unsettled:
            self._unsettled.discard(request_id)
            self._ended.append(Ended(request_id, reason))
            self._schedule_flush()

    def abort_all(self, message: str) -> int:
        """End every open stream here (shutdown): each gets an ABORT with message, the core drops them."""
        streams = list(self.streams.items())
        for rid, stream in streams:
            self.abort(rid)
            stream.queue.put_nowait(RequestDelta(rid, [], FinishReason.ABORTED, message))
        return len(streams)

    def idle(self) -> bool:
        return not self.streams

    async def wait_idle(self) -> None:
        while self.streams:
            await asyncio.sleep(0.02)

    def count_refusal(self, code: str) -> None:
        """A call this api server refused: counted on the engine core's /metrics with the next message."""
        self._unreported_refusals[code] = self._unreported_refusals.get(code, 0) + 1
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if not self._flush_pending:
            self._flush_pending = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_pending = False
        msg = ToCore(self._new, self._ended, overflows=self._unreported_overflows,
                     refused=self._unreported_refusals)
        self._new, self._ended, self._unreported_overflows, self._unreported_refusals = [], [], 0, {}
        self._sock.send(encoder.encode(msg))

    # ---- from the core ---------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            msg = to_frontend_decoder.decode(await self._sock.recv())
            if msg.status is not None:
                self._set_status(msg.status)
            if msg.refused:
                self._refuse(msg.refused)
            if msg.deltas:
                self._deliver(msg)

    def _set_status(self, status: Status) -> None:
        if status.describe:
            self.describe = executor_pb2.DescribeResponse.FromString(status.describe)
        if status.ready == self.ready.is_set():
            return
        if status.ready:
            self.ready.set()
        else:
            self.ready.clear()
        if self.on_ready_change is not None:
            self.on_ready_change(status.ready)

    def _refuse(self, refused: list[Refused]) -> None:
        for r in refused:
            stream = self.streams.pop(r.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(RequestError(REFUSAL_CODES[r.why], r.message))

    def _deliver(self, msg: ToFrontend) -> None:
        streams = self.streams
        for d in msg.deltas:
            stream = streams.get(d.request_id)
            if stream is None:
                continue
            queue = stream.queue
            if d.finish_reason is not None:
                del streams[d.request_id]
                stream.executor_unavailable = d.unavailable
                if settled_by_frontend(d.finish_reason, stream.stop_strings):
                    self._unsettled.add(d.request_id)
            elif queue.qsize() >= self.max_buffered:
                self._overflow(d.request_id, queue)
                continue
            queue.put_nowait(as_delta(d))

    def _overflow(self, request_id: str, queue: asyncio.Queue[Any]) -> None:
        """The client stopped reading: abort in the core (frees its KV) and end the stream after what it has."""
        self.num_overflowed += 1
        self._unreported_overflows += 1
        self.abort(request_id)
        queue.put_nowait(RequestDelta(request_id, [], FinishReason.ABORTED,
                                      f"client read too slowly: {self.max_buffered} responses were buffered "
                                      "(--max-stream-buffer)"))


def as_delta(d: Delta) -> RequestDelta:
    logprobs = [TokenLogprob(t, v, tuple((i, x) for i, x in top)) for t, v, top in d.logprobs] if d.logprobs else []
    return RequestDelta(d.request_id, d.token_ids, d.finish_reason, d.error, logprobs)
