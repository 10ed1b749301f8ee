"""The HTTP port's connections, guarded against clients that hold them without finishing a request (slowloris).

aiohttp has no timeout on reading a request's line and headers or its body, and no cap on connections: a few
thousand connections sending a header byte every few seconds held every file descriptor of the process, so new
HTTP requests and the gRPC requests of the same api server failed. Each accepted connection is a Connection (an
asyncio protocol in front of aiohttp's RequestHandler) that ConnectionGuard watches:

- from the first byte of a request until its headers are in: at most --http-header-timeout, then it is closed;
- from its headers until its body is in: at most --http-body-timeout, then 408 and closed (body_deadline);
  a declared Content-Length over the body limit is a 413 from the headers alone, a compressed body (any
  Content-Encoding but identity) a 415 from the headers alone, and a body that cannot be read (the client gone
  mid-body) is a 400 that ends the connection without an error logged;
- between requests (and before the first): aiohttp's own keep-alive timeout, --http-timeout-keep-alive;
- while a response is written: the kernel holds at most --http-send-buffer unread bytes of it (SO_SNDBUF, and as
  much again in the transport before writes wait); a connection whose writes wait (its client stopped reading) for
  --http-write-timeout without draining is aborted: its handler is cancelled, which closes its generate() streams,
  which abort their requests and free their blocks. aiohttp has no write timeout: a stream whose client stopped
  reading held its connection, its handler and ~4 MB of kernel buffers for ever (busy, so never evicted);
- at most --http-max-connections open (and at most half the process's open-file limit, so the HTTP port can
  never starve gRPC): past it, the connection that has waited longest for a request (an idle keep-alive or a slow
  sender) is closed to make room; when every connection is serving a request, the new one gets 503 and is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ssl import SSLContext

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from scheduler_service.frontend.openai.errors import ApiError

log = logging.getLogger("pagedserve.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REPORT_INTERVAL_S = 10.0  # at most one log line this often about closed connections
MIN_CONNECTIONS = 16
LINGER_S = 1.0  # after a last answer (503, 408): how long what the client still sends is read and dropped


@dataclass(slots=True, frozen=True)
class HttpLimits:
    """--http-header-timeout, --http-body-timeout, --http-timeout-keep-alive, --http-max-connections,
    --http-write-timeout, --http-send-buffer."""

    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 4096
    write_timeout: float = 30.0
    send_buffer: int = 256 * 1024  # 0: the kernel's own (autotuned, up to net.ipv4.tcp_wmem's maximum)


def connection_cap(max_connections: int, open_file_limit: int) -> int:
    """The connections the HTTP port may hold: the flag, but at most half the open-file limit, so that gRPC,
    the engine core's socket and the rest of the process always have descriptors."""
    return max(1, min(max_connections, max(MIN_CONNECTIONS, open_file_limit // 2)))


class Connection(asyncio.Protocol):
    """One accepted connection: aiohttp's handler behind the guard's timers and cap."""

    __slots__ = ("busy", "dropping", "guard", "handler", "header_timer", "served", "transport", "write_timer")

    def __init__(self, handler: RequestHandler, guard: ConnectionGuard) -> None:
        self.handler = handler
        self.guard = guard
        self.transport: asyncio.Transport | None = None
        self.busy = False  # a request's headers are in and its handler has not finished
        self.served = False  # admitted under the cap: the handler has the transport
        self.dropping = False  # answered for the last time: what still comes in is dropped
        self.header_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None  # while writes wait for the client to read

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        bound_send_buffer(transport, self.guard.limits.send_buffer)  # type: ignore[arg-type]
        if self.guard.admit(self):
            self.served = True
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.dropping:
            return
        if not self.busy and self.header_timer is None and data:  # the first byte of a request
            self.header_timer = self.guard.loop.call_later(self.guard.limits.header_timeout, self._headers_late)
        self.handler.data_received(data)

    def eof_received(self) -> None:
        if self.served and not self.dropping:
            self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._cancel_write_timer()
        self.guard.forget(self)
        if self.served:
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        """The transport holds more than its high-water mark: the client has not read what the kernel holds."""
        if self.write_timer is None:
            self.write_timer = self.guard.loop.call_later(self.guard.limits.write_timeout, self._write_late)
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        self.handler.resume_writing()

    def request_started(self) -> None:
        self.busy = True
        self._cancel_timer()
        self.guard.idle.pop(self, None)

    def request_ended(self) -> None:
        self.busy = False
        if self.transport is not None and not self.transport.is_closing():
            self.guard.idle[self] = None  # waits for its next request from now: the last to evict

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def finish(self) -> None:
        """After a last answer: send it and end our side, drop what the client still sends, and close when it
        does or after LINGER_S (closing at once with its bytes unread would reset the connection, which can
        destroy the answer before the client reads it)."""
        self.dropping = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.can_write_eof():
            transport.write_eof()
        self.guard.loop.call_later(LINGER_S, transport.close)

    def _cancel_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _cancel_write_timer(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def _write_late(self) -> None:
        """Writes waited --http-write-timeout: the connection is reset with what it holds unsent (a close would wait
        to send it, and the kernel would keep the socket and its buffer while the client's window stays shut), and
        aiohttp cancels the handler, whose streams abort their requests."""
        self.write_timer = None
        self.guard.count("stalled")
        transport = self.transport
        if transport is None:
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()

    def _headers_late(self) -> None:
        self.header_timer = None
        if not self.busy:
            self.guard.count("slow")
            self.close()


class BodyUnread(enum.Enum):
    """Why a request's body was not read whole; the connection is not kept alive after its answer."""

    TOO_LARGE = enum.auto()  # its Content-Length is over the limit
    ENCODED = enum.auto()  # it is compressed (Content-Encoding): never inflated, not read
    BROKEN = enum.auto()  # it could not be read (corrupt encoding, connection lost)


BODY_UNREAD = web.RequestKey("body_unread", BodyUnread)


class ConnectionGuard:
    """The connections of one HTTP port: the cap, the header timer, the body deadline (as middlewares), and one
    log line every REPORT_INTERVAL_S at most about what it closed."""

    def __init__(self, limits: HttpLimits, max_connections: int) -> None:
        self.limits = limits
        self.max_connections = max_connections
        self.loop = asyncio.get_running_loop()
        self.open: set[Connection] = set()
        self.idle: dict[Connection, None] = {}  # waiting for a request, longest-waiting first
        self.closed = {"slow": 0, "evicted": 0, "refused": 0, "body": 0, "stalled": 0}
        self._report: asyncio.TimerHandle | None = None

    def protocol_factory(self, server: web.Server) -> Callable[[], Connection]:
        return lambda: Connection(server(), self)

    def admit(self, conn: Connection) -> bool:
        """Whether the new connection is served; at the cap the longest-idle one makes room, else it is refused."""
        if len(self.open) >= self.max_connections:
            victim = next(iter(self.idle), None)
            if victim is None:
                self.count("refused")
                refuse(conn)
                return False
            self.count("evicted")
            self.forget(victim)
            victim.close()
        self.open.add(conn)
        self.idle[conn] = None
        return True

    def forget(self, conn: Connection) -> None:
        self.open.discard(conn)
        self.idle.pop(conn, None)

    def count(self, what: str) -> None:
        self.closed[what] += 1
        if self._report is None:
            self._report = self.loop.call_later(REPORT_INTERVAL_S, self._log)

    def _log(self) -> None:
        self._report = None
        closed, self.closed = self.closed, dict.fromkeys(self.closed, 0)
        log.info("HTTP port, last %.0f s: closed %d connections without complete headers within "
                 "--http-header-timeout %gs and %d without a complete body within --http-body-timeout %gs, aborted "
                 "%d whose client read nothing of their response for --http-write-timeout %gs (their requests "
                 "aborted); at the cap of %d connections closed %d waiting ones and refused %d (%d open)",
                 REPORT_INTERVAL_S, closed["slow"], self.limits.header_timeout, closed["body"],
                 self.limits.body_timeout, closed["stalled"], self.limits.write_timeout, self.max_connections,
                 closed["evicted"], closed["refused"], len(self.open))

    @web.middleware
    async def track(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """The outermost middleware: the connection is busy (neither timed for headers nor evictable) from its
        request's headers until its response is written."""
        transport = request.transport
        conn = transport.get_protocol() if transport is not None else None
        if not isinstance(conn, Connection):
            return await handler(request)
        conn.request_started()
        try:
            response = await handler(request)
            unread = request.get(BODY_UNREAD, False)
            if not response.prepared:  # written here, so that it is whole before the connection counts as idle
                if unread or response.status == 408:
                    response.force_close()
                with contextlib.suppress(ConnectionError):  # the client left: nothing to answer, nothing to log
                    await response.prepare(request)
                    await response.write_eof()
            if response.status == 408:  # the rest of the body is not worth reading
                conn.finish()
            elif unread in (BodyUnread.TOO_LARGE, BodyUnread.ENCODED):  # the rest is not worth reading
                conn.finish()
                request.content.feed_eof()
            elif unread is BodyUnread.BROKEN:  # aiohttp would read it again after the answer, and log the error
                request.content.feed_eof()
            return response
        finally:
            conn.request_ended()

    @web.middleware
    async def body_deadline(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Read the whole body within --http-body-timeout of the headers (handlers then read it from memory)."""
        if not request.body_exists:
            return await handler(request)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            request[BODY_UNREAD] = BodyUnread.ENCODED
            raise ApiError(415, f"Unsupported Media Type: Content-Encoding {encoding[:32]!r}; request bodies are "
                           "accepted uncompressed only (Content-Encoding: identity)")
        if request.content_length is not None and request.content_length > request.client_max_size:
            request[BODY_UNREAD] = BodyUnread.TOO_LARGE  # refused from its headers; aiohttp drains what was sent
            raise ApiError(413, f"the request body is larger than {request.client_max_size} bytes")
        try:
            await asyncio.wait_for(request.read(), self.limits.body_timeout)
        except web.HTTPRequestEntityTooLarge:  # chunked past the limit: the rest is not worth reading
            request[BODY_UNREAD] = BodyUnread.TOO_LARGE
            raise ApiError(413, f"the request body is larger than {request.client_max_size} bytes") from None
        except TimeoutError:
            self.count("body")
            raise ApiError(408, f"the request body did not arrive within --http-body-timeout "
                           f"{self.limits.body_timeout:g}s") from None
        except (RequestPayloadError, HttpProcessingError) as e:  # e.g. a malformed chunked encoding
            request[BODY_UNREAD] = BodyUnread.BROKEN
            raise ApiError(400, f"the request body could not be read: {e}") from None
        except ConnectionError:  # the client closed mid-body: the answer goes nowhere
            request[BODY_UNREAD] = BodyUnread.BROKEN
            raise ApiError(400, "the connection closed before the request body arrived") from None
        return await handler(request)


def bound_send_buffer(transport: asyncio.Transport, size: int) -> None:
    """At most `size` unread bytes in the kernel (SO_SNDBUF, which Linux doubles for its bookkeeping) and as many in
    the transport: past them, writes wait for the client to read, and --http-write-timeout counts."""
    if size <= 0:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    transport.set_write_buffer_limits(high=size)


def refuse(conn: Connection) -> None:
    """503 and close, for a connection past the cap when every connection serves a request."""
    body = json.dumps({"error": {"message": "too many open connections (--http-max-connections); retry later",
                                 "type": "service_unavailable_error", "param": None,
                                 "code": "service_unavailable_error"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\nRetry-After: 1\r\n\r\n").encode()
    if conn.transport is not None:
        conn.transport.write(head + body)
        conn.finish()


class GuardedSite(web.BaseSite):
    """aiohttp's TCPSite, with each accepted connection behind the guard (and TLS handshakes timed like headers)."""

    __slots__ = ("_guard", "_host", "_port", "_reuse_port")

    def __init__(self, runner: web.BaseRunner, guard: ConnectionGuard, host: str, port: int,
                 ssl_context: SSLContext | None = None, reuse_port: bool = False) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        self._guard, self._host, self._port, self._reuse_port = guard, host, port, reuse_port

    @property
    def name(self) -> str:
        return f"{'https' if self._ssl_context else 'http'}://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        factory = self._guard.protocol_factory(server)
        reuse_port = self._reuse_port or None
        if self._ssl_context is None:  # (a handshake timeout without TLS is an error)
            self._server = await self._guard.loop.create_server(factory, self._host, self._port, backlog=self._backlog,
                                                                reuse_port=reuse_port)
        else:
            self._server = await self._guard.loop.create_server(
                factory, self._host, self._port, backlog=self._backlog, reuse_port=reuse_port, ssl=self._ssl_context,
                ssl_handshake_timeout=self._guard.limits.header_timeout)
