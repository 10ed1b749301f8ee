"""Supervision of the engine core's children: --api-server-count api server processes, restarted when one dies."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

from protos.wire import read_secret
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.frontend.api_server import run_api_server
from scheduler_service.link_auth import tenant_key

log = logging.getLogger("pagedserve.core")
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
STABLE_AFTER_S = 10.0


@dataclass(slots=True)
class ApiServerProcess:
    index: int
    generation: int
    process: BaseProcess
    started: float
    quick_deaths: int = 0

    @property
    def identity(self) -> bytes:
        return api_server_identity(self.index, self.generation)


def api_server_identity(index: int, generation: int) -> bytes:
    """The api server's ZeroMQ identity: a restarted one is a new peer to the core."""
    return f"api-{index}-{generation}".encode()


class ApiServers:
    """Starts the front-ends, watches their sentinels, and on a death calls on_death(identity) (the core
    aborts that process's requests) and starts a new one in its place."""

    def __init__(self, config: SchedulerServiceConfig, core_address: str, listen: str,
                 on_death: Callable[[bytes], int]) -> None:
        self.config = config
        self.core_address = core_address
        self.listen = listen
        self.on_death = on_death
        self.servers: list[ApiServerProcess] = []
        self.stopping = False
        self._ctx = multiprocessing.get_context("spawn")
        self._restarts: set[asyncio.Task[None]] = set()
        # keys the API keys' prefix-cache tenants alike in every api server (and, from the link secret, alike in
        # every front-end of the deployment)
        self._tenant_secret = tenant_key(read_secret(config.engine_core_secret_file)) or os.urandom(32)

    def names(self) -> set[bytes]:
        """The engine-core link names of the api servers it runs now."""
        return {server.identity for server in self.servers}

    def start(self) -> None:
        for index in range(self.config.api_server_count or 0):
            self.servers.append(self._spawn(index, 0, 0))

    def _spawn(self, index: int, generation: int, quick_deaths: int) -> ApiServerProcess:
        identity = api_server_identity(index, generation)
        process = self._ctx.Process(target=run_api_server, name=f"pagedserve-api-{index}", daemon=True,
                                    args=(self.config, index, identity, self.core_address, self.listen,
                                          self._tenant_secret, os.getpid()))
        process.start()
        server = ApiServerProcess(index, generation, process, time.monotonic(), quick_deaths)
        asyncio.get_running_loop().add_reader(server.process.sentinel, self._ended, server)
        return server

    def _ended(self, server: ApiServerProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(server.process.sentinel)
        server.process.join(timeout=1.0)
        if self.stopping:
            return
        aborted = self.on_death(server.identity)
        stable = time.monotonic() - server.started > STABLE_AFTER_S
        quick = 0 if stable else server.quick_deaths + 1
        delay = RESTART_BACKOFF_S[min(quick, len(RESTART_BACKOFF_S) - 1)]
        log.error("api server %d (pid %s) died with exit code %s; aborted its %d requests; restarting it in %.1fs",
                  server.index, server.process.pid, server.process.exitcode, aborted, delay)
        task = asyncio.ensure_future(self._restart(server, delay, quick))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, old: ApiServerProcess, delay: float, quick_deaths: int) -> None:
        await asyncio.sleep(delay)
        if not self.stopping:
            self.servers[old.index] = self._spawn(old.index, old.generation + 1, quick_deaths)

    async def drain(self, timeout: float) -> None:
        """SIGTERM every front-end (each drains its own streams) and wait for all of them to exit."""
        self.stopping = True
        for task in self._restarts:
            task.cancel()
        for server in self.servers:
            if server.process.is_alive() and server.process.pid is not None:
                os.kill(server.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(s.process.is_alive() for s in self.servers) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.kill()

    def kill(self) -> None:
        self.stopping = True
        for server in self.servers:
            if server.process.is_alive():
                server.process.kill()
                server.process.join(timeout=5)
