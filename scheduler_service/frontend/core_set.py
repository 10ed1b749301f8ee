"""Several engine cores behind one front-end (`--engine-core` repeated, #28): the EngineHandle the public API uses,
over one CoreClient per core. A new request goes to the ready core with the fewest open requests of this
front-end; when a core is lost, its open requests move at once to the ready survivors as continuations (the tokens
delivered so far, same ids, seeds and arrival), without waiting for its restart. With no survivor ready they wait
for whichever core is ready first, the lost one included."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.core_client import CoreClient, RemoteStream

log = logging.getLogger("pagedserve.frontend")


class CoreSet:
    def __init__(self, clients: list[CoreClient]) -> None:
        self.clients = clients
        self.ready = asyncio.Event()
        self.metrics_model_name: str | None = None
        self.on_ready_change: Callable[[bool], object] | None = None
        self.owner: dict[str, CoreClient] = {}
        self.num_moved = 0
        self.describe: executor_pb2.DescribeResponse | None = None
        for client in clients:
            client.on_ready_change = self._readiness
            client.on_lost = self._move_from

    def _describe(self) -> executor_pb2.DescribeResponse | None:
        """A ready core's executor description (the cores serve one model), else any core's."""
        ready = [c for c in self.clients if c.ready.is_set() and c.describe is not None]
        return ready[0].describe if ready else next((c.describe for c in self.clients if c.describe), None)

    async def start(self) -> None:
        for client in self.clients:
            await client.start()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    def add(self, request: Request, queue: asyncio.Queue[Any], stop_strings: bool = False) -> RemoteStream:
        ready = [c for c in self.clients if c.ready.is_set()] or self.clients
        client = min(ready, key=lambda c: len(c.streams))
        stream = client.add(request, queue, stop_strings)
        self.owner[request.request_id] = client
        return stream

    def abort(self, request_id: str) -> None:
        self.finish(request_id, FinishReason.ABORTED)

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        client = self.owner.get(request_id)
        if client is not None:
            client.finish(request_id, reason, error)
            if request_id not in client.streams and not client.settling(request_id):
                del self.owner[request_id]

    def abort_all(self, message: str) -> int:
        self.owner.clear()
        return sum(c.abort_all(message) for c in self.clients)

    def idle(self) -> bool:
        return all(c.idle() for c in self.clients)

    async def wait_idle(self) -> None:
        while not self.idle():
            await asyncio.sleep(0.02)

    def count_refusal(self, code: str) -> None:
        self.clients[0].count_refusal(code)

    def _readiness(self, _: bool) -> None:
        self.describe = self._describe()
        ready = any(c.ready.is_set() for c in self.clients)
        if ready == self.ready.is_set():
            return
        if ready:
            self.ready.set()
        else:
            self.ready.clear()
        if self.on_ready_change is not None:
            self.on_ready_change(ready)

    def _move_from(self, lost: CoreClient) -> None:
        """A core was lost: its open requests go to the ready survivors now, the least loaded first."""
        survivors = [c for c in self.clients if c is not lost and c.ready.is_set()]
        if not survivors or not lost.streams:
            return
        started = time.monotonic()
        moved = lost.release_all()
        for rid, stream in moved:
            target = min(survivors, key=lambda c: len(c.streams))
            target.adopt(rid, stream)
            self.owner[rid] = target
        self.num_moved += len(moved)
        log.warning("engine core %s lost: moved its %d open requests to %d other cores in %.1f ms", lost.address,
                    len(moved), len(survivors), (time.monotonic() - started) * 1e3)
