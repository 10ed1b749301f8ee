"""The engine core: the executor pool (an ExecutorLoop, with its scheduler and executor stream, per executor) plus
request intake from the api server processes and delta routing back to them, one message per step per api server
each way. It does no per-client work: no tokenizing, no detokenizing, no stop strings, no gRPC to clients."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason
from scheduler_service.engine.executor_loop import RequestStream
from scheduler_service.engine.pool import ExecutorPool
from scheduler_service.link_auth import secure_server
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

SUPERSEDED = "superseded: a resumed call of this request took it over"
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
                      stream is not None and settled_by_frontend(delta.finish_reason, stream.stop_strings),
                      invalid=stream is not None and stream.invalid_argument)


class FrontendLink:
    """One api server process as the core sees it: the deltas of its requests in this step, sent to it
    as one message once the step's routing is done."""

    def __init__(self, identity: bytes, core: EngineCore, name: bytes = b"") -> None:
        self.identity = identity
        self.name = name or identity  # the front-end's name: the same across its sessions (reconnections)
        self.last_heard = time.monotonic()
        self.sinks: dict[str, RequestSink] = {}  # its requests the core has not finished with
        self.deltas: list[Delta] = []
        self.refused: list[Refused] = []
        self._core = core

    def put(self, delta: RequestDelta, unavailable: bool, unsettled: bool = False, invalid: bool = False) -> None:
        """unsettled: a final delta whose finish the front-end still settles (its Ended comes later)."""
        if delta.finish_reason is not None and not unsettled:
            self.release(delta.request_id)
        self.deltas.append(delta_to_wire(delta, unavailable, invalid))
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
    """timeout: seconds a front-end may stay silent (it sends a heartbeat every timeout / 4) before the core
    drops it and aborts its requests; the core's own status goes to every front-end as often."""

    def __init__(self, pool: ExecutorPool, address: str, secret: str | None = None, timeout: float = 5.0) -> None:
        self.pool = pool
        self.address = address
        self.timeout = timeout
        self.links: dict[bytes, FrontendLink] = {}
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self._sock.setsockopt(opt, 0)
        self._auth = secure_server(self._ctx, self._sock, secret)
        self._dirty: list[FrontendLink] = []
        self._counters: CoreCounters | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.closing = False  # handing its front-ends back: it takes no new session

    def bind(self) -> None:
        """Bind the address; a tcp:// port 0 becomes the port bound (self.address is what front-ends dial)."""
        self._sock.bind(self.address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._read(), name="core-intake"),
                       asyncio.create_task(self._beat(), name="core-heartbeat")]

    def close(self) -> None:
        """Close the socket and remove its file (ZeroMQ leaves an ipc:// socket file behind)."""
        for task in self._tasks:
            task.cancel()
        if self._auth is not None:
            self._auth.stop()
        self._sock.close(linger=0)
        self._ctx.term()
        remove_ipc_file(self.address)

    # ---- front-ends in ---------------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                key, payload = frames
                msg = to_core_decoder.decode(payload)
            except (ValueError, msgspec.DecodeError) as e:
                # a peer that is not a front-end of this version: one bad message must not end the intake
                # (every front-end would then be dropped as silent)
                log.warning("engine core: refused a message that is not a front-end's (%d frames): %s",
                            len(frames), e)
                continue
            link = self.links.get(key)
            if link is None and (not msg.hello or self.closing):  # a session it never met (it restarted) or dropped
                status = self.status()
                status.unknown = True
                self._sock.send_multipart([key, encoder.encode(ToFrontend(status=status))])
                continue
            if link is None:
                link = self._open(key, msg.frontend)
            link.last_heard = time.monotonic()
            self._take(link, msg)

    def _open(self, identity: bytes, name: bytes) -> FrontendLink:
        """A front-end's new session: its earlier sessions' requests are aborted (it re-submits them here)."""
        for old in [link for link in self.links.values() if name and link.name == name]:
            self.drop_link(old.identity)
        link = self.links[identity] = FrontendLink(identity, self, name)
        return link

    async def _beat(self) -> None:
        """Every timeout / 4: status to every front-end (its heartbeat); drop those silent past the timeout."""
        while True:
            await asyncio.sleep(self.timeout / 4)
            deadline = time.monotonic() - self.timeout
            for link in [link for link in self.links.values() if link.last_heard < deadline]:
                aborted = self.drop_link(link.identity)
                log.warning("front-end %s silent for %.1fs: dropped, aborted its %d requests",
                            link.identity.decode(errors="replace"), self.timeout, aborted)
            beat = encoder.encode(ToFrontend(status=Status(self.pool.ready.is_set())))  # no describe: small
            for link in self.links.values():
                self._sock.send_multipart([link.identity, beat])

    def _take(self, link: FrontendLink, msg: ToCore) -> None:
        if msg.hello:
            self._send(link, ToFrontend(status=self.status()))
        offset = time.monotonic() - msg.sent_at if msg.sent_at else 0.0
        if msg.overflows:
            self.counters().overflows.inc(msg.overflows)
        if msg.refused:
            self.counters().refusals.merge(msg.refused)
        for ended in msg.ended:
            if link.release(ended.request_id):
                self._end(ended.request_id, ended.reason)
        for new in msg.new:
            self._add(link, new, offset)

    def _end(self, request_id: str, reason: FinishReason) -> None:
        if reason is FinishReason.ABORTED:
            self.pool.abort(request_id)
        else:
            self.pool.finish(request_id, reason)

    def _add(self, link: FrontendLink, new: NewRequest, clock_offset: float = 0.0) -> None:
        if new.resume:
            self._supersede(new)
        sink = RequestSink(link)
        try:
            sink.stream = self.pool.add(request_from(new, clock_offset), sink,  # type: ignore[arg-type]
                                        new.stop_strings)
        except QueueFull as e:  # with no executor serving (one was just lost) it is not full: retry shortly
            why = Refusal.QUEUE_FULL if self.pool.ready.is_set() else Refusal.NOT_READY
            self._refuse(link, new.request_id, why, str(e))
            return
        except ValueError as e:
            self._refuse(link, new.request_id, Refusal.DUPLICATE_ID, str(e))
            return
        except RuntimeError as e:
            self._refuse(link, new.request_id, Refusal.NOT_READY, str(e))
            return
        link.sinks[new.request_id] = sink

    def _supersede(self, new: NewRequest) -> None:
        """A continuation replaces the same request of the same tenant still held for another session (a client
        resuming on another front-end before this core noticed the first one gone). The first call, if its
        front-end is still there, ends ABORT at once: it used to wait for a delta that never came, open until its
        client's deadline, its request id still taken on that front-end."""
        for link in self.links.values():
            sink = link.sinks.get(new.request_id)
            if sink is not None and sink.stream is not None and sink.stream.request.tenant == new.tenant:
                link.release(new.request_id)
                self.pool.abort(new.request_id)
                link.put(RequestDelta(new.request_id, [], FinishReason.ABORTED, SUPERSEDED), unavailable=False)
                return

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
        if self._sock.closed:
            return
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

    def drop_frontend(self, name: bytes) -> int:
        """A front-end process died: abort its requests, in every session of it (its clients lost the
        connection with it)."""
        self.counters().restarts.inc()
        return sum(self.drop_link(link.identity) for link in list(self.links.values()) if link.name == name)

    def hand_back(self, keep: set[bytes]) -> int:
        """Shutting down (SIGTERM): tell every front-end session but those of `keep` (its own api servers, which
        drain) that it does not know them any more, so each re-submits its requests to the restarted core (or
        holds them until it is back), and free those requests here; no new session is taken. How many."""
        self.closing = True
        status = Status(False, unknown=True)
        handed = 0
        for link in [link for link in self.links.values() if link.name not in keep]:
            self._send(link, ToFrontend(status=status))
            handed += self.drop_link(link.identity)
        return handed

    def drop_link(self, identity: bytes) -> int:
        """Forget one front-end session and abort its requests (freeing their blocks); how many there were."""
        link = self.links.pop(identity, None)
        if link is None:
            return 0
        if link in self._dirty:
            self._dirty.remove(link)
        request_ids = list(link.sinks)
        for request_id in request_ids:
            link.release(request_id)
            self.pool.abort(request_id)
        return len(request_ids)
