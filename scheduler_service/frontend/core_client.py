"""The engine core as a front-end process sees it: ExecutorLoop's add/abort/finish/describe/ready surface over
one ZeroMQ socket, with one batched message per event-loop turn toward the core. It keeps what each open request
needs to resume it (its NewRequest and the tokens delivered), and when the core is lost (its connection drops, it
stays silent past the timeout, or it says it does not know this session) opens a new session at the same address
and re-submits every open request there as a continuation once the core is ready (docs/architecture.md, #28)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from msgspec.structs import replace

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.core_session import CoreSession
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
    new_request,
    settled_by_frontend,
)

log = logging.getLogger("pagedserve.frontend")
REFUSAL_CODES = {Refusal.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
                 Refusal.DUPLICATE_ID: grpc.StatusCode.ALREADY_EXISTS,
                 Refusal.NOT_READY: grpc.StatusCode.UNAVAILABLE}


@dataclass(slots=True)
class RemoteStream:
    """An api server's record of one sequence it added (what ExecutorLoop.add's RequestStream is in-process),
    with what re-submits it to a core: its NewRequest, the tokens delivered, and the session it was sent in."""

    queue: asyncio.Queue[Any]
    executor_unavailable: bool = False
    invalid_argument: bool = False  # the core ended it for its constraint (INVALID_ARGUMENT)
    stop_strings: bool = False  # a LENGTH finish waits for finish() to settle it (ExecutorLoop.add)
    new: NewRequest | None = None
    delivered: list[int] = field(default_factory=list)
    session: int = 0


@dataclass(slots=True)
class ResumeLimits:
    """secret: --engine-core-secret-file's; timeout: a core silent this long is lost; wait_timeout: how long
    open requests wait for a lost core to come back before they end with UNAVAILABLE."""

    secret: str | None = None
    timeout: float = 5.0
    wait_timeout: float = 60.0


class CoreClient:
    def __init__(self, address: str, identity: bytes, max_buffered: int, limits: ResumeLimits | None = None
                 ) -> None:
        self.address = address
        self.metrics_model_name: str | None = None
        self.identity = identity
        self.max_buffered = max_buffered
        self.limits = limits or ResumeLimits()
        self.describe: executor_pb2.DescribeResponse | None = None
        self.ready = asyncio.Event()
        self.streams: dict[str, RemoteStream] = {}
        self._unsettled: set[str] = set()  # LENGTH finishes the core counts once finish() settles them
        self.on_ready_change: Callable[[bool], object] | None = None
        self.on_lost: Callable[[CoreClient], object] | None = None  # a CoreSet moves the open requests elsewhere
        self.num_overflowed = 0
        self.num_resumed = 0  # requests re-submitted to a core after one was lost
        self.lost_since: float | None = None  # when the core was lost, until a session joins one again
        self._joined = False
        self._unreported_overflows = 0
        self._unreported_refusals: dict[str, int] = {}
        self._session = CoreSession(address, identity, self._receive, self._lost, self.limits.secret,
                                    self.limits.timeout)
        self._new: list[NewRequest] = []
        self._ended: list[Ended] = []
        self._flush_pending = False

    async def start(self) -> None:
        await self._session.start()

    async def close(self) -> None:
        await self._session.close()

    # ---- toward the core -------------------------------------------------------------------

    def add(self, request: Request, queue: asyncio.Queue[Any], stop_strings: bool = False) -> RemoteStream:
        if request.request_id in self.streams:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        new = new_request(request, stop_strings)
        stream = self.streams[request.request_id] = RemoteStream(queue, stop_strings=stop_strings, new=new,
                                                                 delivered=list(request.output_token_ids),
                                                                 session=self._session.number)
        self._new.append(new)
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
        self._session.send(msg)

    # ---- losing a core and resuming on it ------------------------------------------------------

    def _lost(self, reason: str) -> None:
        """The session ended: nothing pending goes to the old core; calls wait (not ready) until a new session
        joins a ready core, which gets every open request again."""
        if self.lost_since is None:
            self.lost_since = time.monotonic()
            log.warning("engine core %s lost (%s): %d open requests wait to resume", self.address, reason,
                        len(self.streams))
        self._joined = False
        self._new, self._ended = [], []
        self._unsettled.clear()
        self._set_ready(False)
        if self.on_lost is not None:
            self.on_lost(self)
        if time.monotonic() - self.lost_since > self.limits.wait_timeout:
            self._fail_open(f"engine core {self.address} lost ({reason}) and not back within "
                            f"--engine-core-wait-timeout {self.limits.wait_timeout:g}s")

    def settling(self, request_id: str) -> bool:
        """Whether a LENGTH finish of this request waits for finish() to settle it."""
        return request_id in self._unsettled

    def release_all(self) -> list[tuple[str, RemoteStream]]:
        """Hand every open request over (to another core): this client forgets them."""
        moved = list(self.streams.items())
        self.streams.clear()
        return moved

    def adopt(self, request_id: str, stream: RemoteStream) -> None:
        """Take over an open request another core lost: re-submit it here as a continuation."""
        stream.session = self._session.number
        self.streams[request_id] = stream
        if stream.new is not None:
            self._new.append(replace(stream.new, output_token_ids=list(stream.delivered), resume=True))
            self._schedule_flush()

    def _fail_open(self, message: str) -> None:
        for rid, stream in list(self.streams.items()):
            del self.streams[rid]
            stream.queue.put_nowait(RequestError(grpc.StatusCode.UNAVAILABLE, message))

    def _join(self) -> None:
        """This session's core is ready: re-submit every open request that an earlier session sent, as a
        continuation (its prompt, the tokens delivered, its arrival time and seed)."""
        self._joined = True
        number = self._session.number
        resumed = [s for s in self.streams.values() if s.session != number]
        for stream in resumed:
            stream.session = number
            if stream.new is not None:
                self._new.append(replace(stream.new, output_token_ids=list(stream.delivered), resume=True))
        if self.lost_since is not None:
            tokens = sum(len(s.delivered) + len(s.new.prompt_token_ids) for s in resumed if s.new is not None)
            log.info("engine core %s back after %.2fs: resumed %d requests (%d tokens to recompute, before prefix "
                     "cache hits)", self.address, time.monotonic() - self.lost_since, len(resumed), tokens)
        self.lost_since = None
        self.num_resumed += len(resumed)
        if resumed:
            self._schedule_flush()

    # ---- from the core ---------------------------------------------------------------------

    def _receive(self, msg: ToFrontend) -> None:
        if msg.status is not None:
            self._set_status(msg.status)
        if msg.refused:
            self._refuse(msg.refused)
        if msg.deltas:
            self._deliver(msg)

    def _set_status(self, status: Status) -> None:
        if status.describe:
            self.describe = executor_pb2.DescribeResponse.FromString(status.describe)
        if status.ready and not self._joined:
            self._join()
        self._set_ready(status.ready)

    def _set_ready(self, ready: bool) -> None:
        set_readiness(self.ready, ready, self.on_ready_change)

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
                stream.invalid_argument = d.invalid
                if settled_by_frontend(d.finish_reason, stream.stop_strings):
                    self._unsettled.add(d.request_id)
            elif queue.qsize() >= self.max_buffered:
                self._overflow(d.request_id, queue)
                continue
            else:
                stream.delivered += d.token_ids
            if d.prompt_logprobs is not None and stream.new is not None:  # a re-submission (#28) asks no more
                stream.new.sampling = dataclasses.replace(stream.new.sampling, prompt_logprobs=None)
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
    logprobs = logprobs_from_wire(d.logprobs) if d.logprobs else []
    prompt = None if d.prompt_logprobs is None else logprobs_from_wire(d.prompt_logprobs)
    return RequestDelta(d.request_id, d.token_ids, d.finish_reason, d.error, logprobs, prompt)


def logprobs_from_wire(logprobs: list[tuple[int, float, list[tuple[int, float]]]]) -> list[TokenLogprob]:
    return [TokenLogprob(t, v, tuple((i, x) for i, x in top)) for t, v, top in logprobs]


def set_readiness(event: asyncio.Event, ready: bool, on_change: Callable[[bool], object] | None) -> None:
    """Set or clear a readiness event, telling on_change only when it flips."""
    if ready == event.is_set():
        return
    if ready:
        event.set()
    else:
        event.clear()
    if on_change is not None:
        on_change(ready)
