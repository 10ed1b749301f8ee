"""Engine cores by name (`--engine-core dns:///NAME:PORT`, #28): every address NAME resolves to is a core, reached
at tcp://ADDRESS:PORT. The name is re-resolved every --executor-resolve-interval seconds with the executor pool's
Resolver (scheduler_service/name_resolution.py: --executor-hosts-file first, then DNS), so a core that restarts
at a new address, or a scaled core tier, is followed at run time: new addresses join the front-end's CoreSet,
vanished ones are retired there (their requests move to a ready core once they are lost)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from scheduler_service.config import DNS_SCHEME, ExecutorTarget, parse_target
from scheduler_service.frontend.core_client import CoreClient
from scheduler_service.frontend.core_set import CoreSet
from scheduler_service.name_resolution import Resolver

log = logging.getLogger("pagedserve.frontend")


def is_dns(address: str) -> bool:
    return address.startswith(DNS_SCHEME)


def parse_core_name(text: str) -> ExecutorTarget:
    """dns:///NAME:PORT as a target; SystemExit naming --engine-core when it is not one."""
    try:
        return parse_target(text)
    except ValueError:
        raise SystemExit(f"--engine-core: {text!r} is neither tcp://HOST:PORT, ipc://PATH nor "
                         f"{DNS_SCHEME}NAME:PORT") from None


def core_address(address: str) -> str:
    """A resolved HOST:PORT as the ZeroMQ endpoint of a core."""
    return f"tcp://{address}"


class CoreMembership:
    def __init__(self, cores: CoreSet, names: list[str], connect: Callable[[str], CoreClient], interval: float,
                 resolver: Resolver | None = None) -> None:
        self.cores = cores
        self.targets = [parse_core_name(name) for name in names]
        self.connect = connect
        self.interval = interval
        self.resolver = resolver or Resolver()
        self.fixed = cores.addresses()  # the tcp:// and ipc:// cores given as such: never retired
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        """Resolve the names once: cores at new addresses join, those at vanished ones are retired."""
        found = {core_address(a) for a in await self.resolver.resolve(self.targets)}
        for address in sorted(found - self.cores.addresses()):
            await self.cores.join(address, self.connect)
        for address in self.cores.addresses() - found - self.fixed:
            log.info("engine core %s is no longer among %s: retired", address,
                     ", ".join(str(t) for t in self.targets))
            self.cores.retire(address)
        await self.cores.sweep()

    async def start(self) -> None:
        """The first resolution now, then one every interval."""
        await self.refresh()
        self._task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.refresh()
            except Exception:  # a failed round keeps the cores as they are; the next one tries again
                log.exception("re-resolving the engine cores failed")
