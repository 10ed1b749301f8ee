"""Several engine cores behind one front-end (`--engine-core` repeated, #28): the EngineHandle the public API uses,
over one CoreClient per core. A new request goes to the ready core with the fewest open requests of this
front-end, or, where its prompt starts with at least AFFINITY_TOKENS tokens, to the core its prefix hashes to
among those within AFFINITY_SLACK of the least loaded (rendezvous hashing over the prefix, its cache scope and the
core's address: every front-end picks the same core for a prefix, so requests sharing a system prompt meet its
cached blocks); when a core is lost, its open requests move at once to the ready survivors as continuations (the
tokens delivered so far, same ids, seeds and arrival), without waiting for its restart. With no survivor ready they wait
for whichever core is ready first, the lost one included. With dns:///NAME:PORT (frontend/core_membership.py) the
set changes at run time: a core whose address NAME no longer resolves to is retired (no new requests; once lost,
its requests move to a ready core; once it holds none, it is closed)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.core_client import CoreClient, RemoteStream, set_readiness

log = logging.getLogger("pagedserve.frontend")
AFFINITY_TOKENS = 16  # a prompt's leading tokens that choose its core (a block's worth: shorter prompts cache nothing)
AFFINITY_SLACK = 8  # open requests more than the least loaded core that the prefix's core may have and still get it


class CoreSet:
    def __init__(self, clients: list[CoreClient]) -> None:
        self.clients = clients
        self.ready = asyncio.Event()
        self.metrics_model_name: str | None = None
        self.on_ready_change: Callable[[bool], object] | None = None
        self.owner: dict[str, CoreClient] = {}
        self.num_moved = 0
        self.describe: executor_pb2.DescribeResponse | None = None
        self.retired: set[CoreClient] = set()
        for client in clients:
            self._watch(client)

    def _watch(self, client: CoreClient) -> None:
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

    def addresses(self) -> set[str]:
        """The addresses of the cores in service (not retired)."""
        return {c.address for c in self.clients if c not in self.retired}

    async def join(self, address: str, connect: Callable[[str], CoreClient]) -> None:
        """A core at `address` enters service: a retired client of it returns, else a new one is started."""
        for client in self.clients:
            if client.address == address:
                self.retired.discard(client)
                return
        client = connect(address)
        self._watch(client)
        self.clients.append(client)
        await client.start()
        log.info("engine core %s joined (%d cores)", address, len(self.clients))

    def retire(self, address: str) -> None:
        """No new requests for the core at `address` (its name no longer resolves to it)."""
        self.retired |= {c for c in self.clients if c.address == address}
        self._hand_over()

    async def sweep(self) -> None:
        """Close the retired cores that hold no request any more."""
        self._hand_over()
        for client in [c for c in self.retired if not c.streams]:
            self.retired.discard(client)
            self.clients.remove(client)
            await client.close()
            log.info("engine core %s retired (%d cores)", client.address, len(self.clients))

    def _hand_over(self) -> None:
        """Retired cores that are lost hand their open requests to a ready core, if one is."""
        for client in self.retired:
            if not client.ready.is_set():
                self._move_from(client)

    def add(self, request: Request, queue: asyncio.Queue[Any], stop_strings: bool = False) -> RemoteStream:
        serving = [c for c in self.clients if c not in self.retired] or self.clients
        ready = [c for c in serving if c.ready.is_set()] or serving
        client = place(request, ready)
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
        if self.clients:
            self.clients[0].count_refusal(code)

    def _readiness(self, _: bool) -> None:
        self.describe = self._describe()
        self._hand_over()
        set_readiness(self.ready, any(c.ready.is_set() for c in self.clients), self.on_ready_change)

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


def place(request: Request, cores: list[CoreClient]) -> CoreClient:
    """The core for a new request: the least loaded, or its prefix's core where that is nearly as free."""
    least = min(len(c.streams) for c in cores)
    prompt = request.prompt_token_ids
    if len(prompt) < AFFINITY_TOKENS:
        return min(cores, key=lambda c: len(c.streams))
    near = [c for c in cores if len(c.streams) <= least + AFFINITY_SLACK]
    prefix = ",".join(map(str, prompt[:AFFINITY_TOKENS])) + f"|{request.tenant}|{request.cache_salt}"
    return max(near, key=lambda c: hashlib.blake2b(f"{prefix}|{c.address}".encode(), digest_size=8).digest())
