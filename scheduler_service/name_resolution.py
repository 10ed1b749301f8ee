"""dns:///NAME:PORT names, resolved and re-resolved, for both tiers: which executors the pool should hold
(--executor), and which engine cores a front-end connects to (--engine-core, frontend/core_membership.py)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from scheduler_service.config import ExecutorTarget

log = logging.getLogger("pagedserve.membership")
# getaddrinfo(host, port) -> [(family, type, proto, canonname, sockaddr)], as asyncio's loop.getaddrinfo.
AddrInfo = Sequence[tuple[int, int, int, str, tuple[Any, ...]]]
GetAddrInfo = Callable[[str, int], Awaitable[AddrInfo]]


def read_hosts(path: Path) -> dict[str, list[str]]:
    """A hosts(5)-format file: `ADDRESS NAME [NAME...]` lines, # comments; NAME -> addresses in file order."""
    names: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        for name in fields[1:]:
            names.setdefault(name.lower(), []).append(fields[0])
    return names


async def system_getaddrinfo(host: str, port: int) -> AddrInfo:
    return await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)


def pick_family(infos: AddrInfo) -> list[str]:
    """IPv4 addresses if there are any, else IPv6: a dual-stack name lists each executor once per family,
    and two streams to one executor would each drop the other's state."""
    v4 = [info[4][0] for info in infos if info[0] == socket.AF_INET]
    v6 = [info[4][0] for info in infos if info[0] == socket.AF_INET6]
    return list(dict.fromkeys(v4 or v6))


class Resolver:
    """Turns targets into executor addresses. A dns:/// name is looked up in --executor-hosts-file when that
    file names it (re-read at every resolution), else through the system resolver."""

    def __init__(self, hosts_file: str | None = None, getaddrinfo: GetAddrInfo = system_getaddrinfo) -> None:
        self.hosts_file = Path(hosts_file) if hosts_file else None
        self.getaddrinfo = getaddrinfo
        self._last: dict[ExecutorTarget, set[str]] = {}

    async def resolve(self, targets: list[ExecutorTarget]) -> set[str]:
        hosts = self._hosts()
        out: set[str] = set()
        for target in targets:
            out |= await self._one(target, hosts) if target.dns else {target.address}
        return out

    def _hosts(self) -> dict[str, list[str]]:
        if self.hosts_file is None:
            return {}
        try:
            return read_hosts(self.hosts_file)
        except OSError as e:
            log.warning("cannot read --executor-hosts-file %s (%s); using DNS only", self.hosts_file, e)
            return {}

    async def _one(self, target: ExecutorTarget, hosts: dict[str, list[str]]) -> set[str]:
        listed = hosts.get(target.host.lower())
        if listed is not None:
            found = {ExecutorTarget(ip, target.port).address for ip in listed}
        else:
            found = await self._lookup(target)
        if found != self._last.get(target):
            log.info("%s resolves to %s", target, ", ".join(sorted(found)) or "nothing")
        self._last[target] = found
        return found

    async def _lookup(self, target: ExecutorTarget) -> set[str]:
        try:
            infos = await self.getaddrinfo(target.host, target.port)
        except socket.gaierror as e:
            if e.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return set()  # the name has no address now: a headless Service with no ready pod
            log.warning("resolving %s failed (%s); keeping its last addresses", target, e)
            return self._last.get(target, set())
        return {ExecutorTarget(ip, target.port).address for ip in pick_family(infos)}
