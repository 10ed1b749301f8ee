"""A front-end as a tier of its own: `python -m scheduler_service.frontend --engine-core ADDR --listen HOST:PORT`.
The same api server as the engine core's children (gRPC and OpenAI HTTP over one GenerationServicer), on any
host, connected to an engine core by address; it outlives the core (its requests resume when the core is back)
and drains on SIGTERM. Several on one host share the public ports (SO_REUSEPORT)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import uuid

import uvloop

from client.port_file import PortFile
from protos.wire import read_secret
from scheduler_service.config import SchedulerServiceConfig, build_parser, parse_config
from scheduler_service.frontend.api_server import (
    core_client,
    drain,
    follow_readiness,
    open_api_server,
    record_api_ports,
)
from scheduler_service.frontend.core_client import CoreClient
from scheduler_service.frontend.core_membership import CoreMembership, is_dns, parse_core_name
from scheduler_service.frontend.core_set import CoreSet
from scheduler_service.link_auth import check_address, tenant_key
from scheduler_service.name_resolution import Resolver
from scheduler_service.process import (
    bind_cores,
    configure_logging,
    freeze_startup_objects,
    lower_priority,
    raise_open_file_limit,
)

log = logging.getLogger("pagedserve.frontend")
PROG = "python -m scheduler_service.frontend"
DESCRIPTION = ("pagedserve front-end: the public gRPC and OpenAI HTTP ports over engine cores reached by "
               "--engine-core (the scheduler's flags: those of the ports, API keys, limits and the core link apply)")


def frontend_name() -> bytes:
    """This front-end's name toward cores: unique per process, readable in their logs."""
    return f"fe-{socket.gethostname()[:24]}-{os.getpid()}-{uuid.uuid4().hex[:6]}".encode()


def engine_handle(config: SchedulerServiceConfig, addresses: list[str]
                  ) -> tuple[CoreClient | CoreSet, CoreMembership | None]:
    """One core's CoreClient, or a CoreSet over several; with dns:/// names, the CoreMembership following them."""
    name = frontend_name()
    names = [a for a in addresses if is_dns(a)]
    if len(addresses) == 1 and not names:
        return core_client(config, name, addresses[0]), None
    cores = CoreSet([core_client(config, name, address) for address in addresses if not is_dns(address)])
    if not names:
        return cores, None
    membership = CoreMembership(cores, names, lambda address: core_client(config, name, address),
                                config.executor_resolve_interval, Resolver(config.executor_hosts_file))
    return cores, membership


async def serve_frontend(config: SchedulerServiceConfig, engine_cores: list[str]) -> None:
    core, membership = engine_handle(config, engine_cores)
    await core.start()
    if membership is not None:
        await membership.start()
    tenants = tenant_key(read_secret(config.engine_core_secret_file))
    if tenants is None and (config.api_key or config.api_key_file):
        log.warning("API keys without --engine-core-secret-file: this front-end's tenant digests are its own, so "
                    "its tenants share no cached prefix with other front-ends")
    api = await open_api_server(config, core, config.listen, reuse_port=True, tenant_secret=tenants,
                                refusal_listener=core.count_refusal)
    record_api_ports(PortFile(config.port_file), api)
    await follow_readiness(api, core)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    freeze_startup_objects()
    log.info("front-end (pid %d) serving %s%s over engine core %s", os.getpid(), config.listen,
             f" and HTTP {config.http_listen}" if config.http_listen else "", ", ".join(engine_cores))
    await stop.wait()
    log.info("SIGTERM: refusing new requests, draining for up to %.1fs", config.shutdown_timeout)
    await drain(config, api, core)
    if membership is not None:
        await membership.stop()
    with contextlib.suppress(Exception):
        await core.close()


def run(argv: list[str] | None = None, prog: str = PROG) -> int:
    configure_logging()
    config = parse_config(argv, build_parser(prog, DESCRIPTION))
    if not config.engine_core:
        raise SystemExit("--engine-core is required: the engine core's tcp://HOST:PORT, ipc://PATH or "
                         "dns:///NAME:PORT")
    for address in config.engine_core:
        name = f"tcp://{parse_core_name(address).address}" if is_dns(address) else address
        check_address(name, read_secret(config.engine_core_secret_file), "--engine-core")
    raise_open_file_limit()
    lower_priority(config.cpu_nice)
    bind_cores(config.cpu_cores)
    uvloop.run(serve_frontend(config, config.engine_core))
    return 0
