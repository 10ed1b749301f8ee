"""The engine core: the executor pool (an ExecutorLoop, with its scheduler and executor stream, per executor) plus
request intake from the api server processes and delta routing back to them, one message per step per api server
each way. It does no per-client work: no tokenizing, no detokenizing, no stop strings, no gRPC to clients."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason
from scheduler_service.engine.executor_loop import RequestStream
from scheduler_service.engine.pool import ExecutorPool
from scheduler_service.messages import (
    Delta,
    NewRequest,
    QueueFull,
    Refusal,
    RefusalCounter,
    Refused,
    Status,
    ToCore,
    ToFrontend,
    delta_to_wire,
    encoder,
    remove_ipc_file,
    request_from,
    settled_by_frontend,
    to_core_decoder,
)

log = logging.getLogger("pagedserve.core")


class RequestSink:
    """Stands in for one request's queue in the ExecutorLoop: its deltas go to its api server's link. It and the
    request's RequestStream refer to each other (the stream's queue is the sink) until the link releases it,
    which every way a request ends does: then refcounting frees both at once, not a rare full collection."""

    __slots__ = ("link", "stream")

    def __init__(self, link: FrontendLink) -> None:
        self.link = link
        self.stream: RequestStream | None = None

    def put_nowait(self, delta: RequestDelta) -> None:
        stream = self.stream
        self.link.put(delta, stream is not None and stream.executor_unavailable,
                      stream is not None and settled_by_frontend(delta.finish_reason, stream.stop_strings))


class FrontendLink:
    """One api server process as the core sees it: the deltas of its requests in this step, sent to it
    as one message once the step's routing is done."""

    def __init__(self, identity: bytes, core: EngineCore) -> None:
        self.identity = identity
        self.sinks: dict[str, RequestSink] = {}  # its requests the core has not finished with
        self.deltas: list[Delta] = []
        self.refused: list[Refused] = []
        self._core = core

    def put(self, delta: RequestDelta, unavailable: bool, unsettled: bool = False) -> None:
        """unsettled: a final delta whose finish the front-end still settles (its Ended comes later)."""
        if delta.finish_reason is not None and not unsettled:
            self.release(delta.request_id)
        self.deltas.append(delta_to_wire(delta, unavailable))
        if len(self.deltas) == 1:
            self._core.mark_dirty(self)

    def release(self, request_id: str) -> bool:
        """The core is done with this request: unlink its sink from its stream; False if it was not here."""
        sink = self.sinks.pop(request_id, None)
        if sink is None:
            return False
        sink.stream = None
        return True


class CoreCounters:
    """Process-layout series, on the engine's registry: the one /metrics of the service."""

    def __init__(self, registry: CollectorRegistry, model_name: str = "") -> None:
        self.refusals = RefusalCounter(lambda: model_name)
        registry.register(self.refusals)
        self.restarts = Counter("pagedserve:api_server_restarts", "Front-end processes that died and were restarted",
                                registry=registry)
        self.overflows = Counter("pagedserve:stream_buffer_overflows",
                                 "Streams aborted because their client read too slowly (--max-stream-buffer)",
                                 registry=registry)


class EngineCore:
    def __init__(self, pool: ExecutorPool, address: str) -> None:
        self.pool = pool
        self.address = address
        self.links: dict[bytes, FrontendLink] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self._sock.setsockopt(opt, 0)
        self._dirty: list[FrontendLink] = []
        self._counters: CoreCounters | None = None
        self._intake: asyncio.Task[None] | None = None

    def bind(self) -> None:
        self._sock.bind(self.address)

    def start(self) -> None:
        self._intake = asyncio.create_task(self._read(), name="core-intake")

    def close(self) -> None:
        """Close the socket and remove its file (ZeroMQ leaves an ipc:// socket file behind)."""
        if self._intake is not None:
            self._intake.cancel()
        self._sock.close(linger=0)
        self._ctx.term()
        remove_ipc_file(self.address)

    # ---- front-ends in ---------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            key, payload = await self._sock.recv_multipart()
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = FrontendLink(key, self)
            self._take(link, to_core_decoder.decode(payload))

    def _take(self, link: FrontendLink, msg: ToCore) -> None:
        if msg.hello:
            self._send(link, ToFrontend(status=self.status()))
        if msg.overflows:
            self.counters().overflows.inc(msg.overflows)
        if msg.refused:
            self.counters().refusals.merge(msg.refused)
        for ended in msg.ended:
            if link.release(ended.request_id):
                self._end(ended.request_id, ended.reason)
        for new in msg.new:
            self._add(link, new)

    def _end(self, request_id: str, reason: FinishReason) -> None:
        if reason is FinishReason.ABORTED:
            self.pool.abort(request_id)
        else:
            self.pool.finish(request_id, reason)

    def _add(self, link: FrontendLink, new: NewRequest) -> None:
        sink = RequestSink(link)
        try:
            sink.stream = self.pool.add(request_from(new), sink, new.stop_strings)  # type: ignore[arg-type]
        except QueueFull as e:
            self._refuse(link, new.request_id, Refusal.QUEUE_FULL, str(e))
            return
        except ValueError as e:
            self._refuse(link, new.request_id, Refusal.DUPLICATE_ID, str(e))
            return
        except RuntimeError as e:
            self._refuse(link, new.request_id, Refusal.NOT_READY, str(e))
            return
        link.sinks[new.request_id] = sink

    def _refuse(self, link: FrontendLink, request_id: str, why: Refusal, message: str) -> None:
        link.refused.append(Refused(request_id, why, message))
        if len(link.refused) == 1 and not link.deltas:
            self.mark_dirty(link)

    # ---- front-ends out --------------------------------------------------------------------

    def mark_dirty(self, link: FrontendLink) -> None:
        """Called on a link's first delta of a step: the flush runs once the step's routing is done."""
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self._flush)
        self._dirty.append(link)

    def _flush(self) -> None:
        dirty, self._dirty = self._dirty, []
        for link in dirty:
            if link.deltas or link.refused:
                msg = ToFrontend(link.deltas, link.refused)
                link.deltas, link.refused = [], []
                self._send(link, msg)

    def _send(self, link: FrontendLink, msg: ToFrontend) -> None:
        self._sock.send_multipart([link.identity, encoder.encode(msg)])

    def status(self) -> Status:
        d = self.pool.describe
        return Status(self.pool.ready.is_set(), d.SerializeToString() if d is not None else b"")

    def broadcast_status(self) -> None:
        status = self.status()
        for link in self.links.values():
            self._send(link, ToFrontend(status=status))

    def counters(self) -> CoreCounters:
        if self._counters is not None:
            return self._counters
        if self.pool.metrics is None:  # no executor met yet: nothing is served on /metrics either
            return CoreCounters(CollectorRegistry())
        self._counters = CoreCounters(self.pool.metrics.registry, self.pool.metrics.model_name)
        return self._counters

    def drop_frontend(self, identity: bytes) -> int:
        """A front-end process died: abort its requests (their clients lost the connection with it)."""
        self.counters().restarts.inc()
        link = self.links.pop(identity, None)
        if link is None:
            return 0
        request_ids = list(link.sinks)
        for request_id in request_ids:
            link.release(request_id)
            self.pool.abort(request_id)
        return len(request_ids)
