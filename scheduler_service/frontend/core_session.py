"""A front-end's connection to one engine core address, kept across the core's restarts. Each session is a fresh
ZeroMQ DEALER socket with its own identity (NAME, then NAME~1, NAME~2, ...) that starts with a hello naming the
front-end. A session ends when the core is lost: its connection drops (a socket monitor sees it at once), it stays
silent past the timeout (it sends its status every timeout / 4), or it answers that it does not know the session
(it restarted, or dropped this front-end as silent). Then the owner hears on_lost and a new session starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from scheduler_service.link_auth import secure_client
from scheduler_service.messages import ToCore, ToFrontend, encoder, to_frontend_decoder

log = logging.getLogger("pagedserve.frontend")
RECONNECT_PAUSE_S = 0.05  # between sessions: a core that is shutting down answers each at once
LOST_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class CoreSession:
    def __init__(self, address: str, name: bytes, on_message: Callable[[ToFrontend], None],
                 on_lost: Callable[[str], None], secret: str | None = None, timeout: float = 5.0) -> None:
        self.address = address
        self.name = name
        self.number = 0
        self.timeout = timeout
        self.last_heard = time.monotonic()
        self._on_message = on_message
        self._on_lost = on_lost
        self._secret = secret
        self._ctx = zmq.asyncio.Context()
        self._sock = self._open()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def identity(self) -> bytes:
        return self.name if self.number == 0 else self.name + f"~{self.number}".encode()

    def _open(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        secure_client(sock, self._secret)
        return sock

    async def start(self) -> None:
        await self._connect()
        self._tasks = [asyncio.create_task(self._run(), name="core-session"),
                       asyncio.create_task(self._beat(), name="core-heartbeat")]

    async def _connect(self) -> None:
        self.last_heard = time.monotonic()
        self._sock.connect(self.address)
        await self._sock.send(encoder.encode(ToCore(hello=True, frontend=self.name, sent_at=time.monotonic())))

    def send(self, msg: ToCore) -> None:
        if self._sock.closed:  # a flush that was due when the session closed (a retired core's, #28)
            return
        msg.sent_at = time.monotonic()
        self._sock.send(encoder.encode(msg))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._close_socket()
        self._ctx.term()

    def _close_socket(self) -> None:
        if self._sock.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._sock.close(linger=0)

    async def _run(self) -> None:
        while True:
            reason = await self._follow()
            self._close_socket()
            self._on_lost(reason)
            await asyncio.sleep(RECONNECT_PAUSE_S)
            self.number += 1
            self._sock = self._open()
            await self._connect()

    async def _follow(self) -> str:
        """Read this session until the core is lost; why it was."""
        monitor = self._sock.get_monitor_socket(LOST_EVENTS)
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                left = self.last_heard + self.timeout - time.monotonic()
                if left <= 0:
                    return f"silent for {self.timeout:g}s"
                ready = dict(await poller.poll(left * 1000))
                if monitor in ready:
                    return self._event(await recv_monitor_message(monitor))  # type: ignore[arg-type]
                if self._sock in ready:
                    why = self._receive(await self._sock.recv())
                    if why:
                        return why
        finally:
            monitor.close(linger=0)

    def _event(self, event: dict[str, object]) -> str:
        if event["event"] == zmq.EVENT_DISCONNECTED:
            return "its connection closed"
        return "the CURVE handshake failed (is --engine-core-secret-file the core's?)"

    def _receive(self, payload: bytes) -> str:
        """Why the session is lost after this message ("" while it is not). A message that does not decode, or
        whose handling fails, ends the session as a lost core does (logged): its open requests are resumed on the
        next session, where before the failure stopped this session's reading and every stream on it hung."""
        self.last_heard = time.monotonic()
        try:
            msg = to_frontend_decoder.decode(payload)
            if msg.status is not None and msg.status.unknown:
                return "it does not know this session (it restarted, or dropped this front-end)"
            self._on_message(msg)
        except Exception:
            log.exception("engine core %s: a message failed to decode or to be handled", self.address)
            return "a message from it failed (logged above)"
        return ""

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.timeout / 4)
            with contextlib.suppress(zmq.ZMQError):
                self.send(ToCore())
