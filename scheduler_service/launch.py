"""python -m scheduler_service: the engine core with --api-server-count api server processes, or with
--api-server-count 0 the single-process layout (the api server's lifecycle over the in-process executor pool);
with --engine-core-listen and --api-server-count 0, the engine core alone (its front-ends run on their own)."""

from __future__ import annotations

import logging

import uvloop

from client.port_file import PortFile
from scheduler_service.config import SchedulerServiceConfig, build_parser, parse_config
from scheduler_service.engine.core_process import (
    make_pool,
    run_engine_core,
    start_metrics,
    start_until_stopped,
    stop_on_signals,
)
from scheduler_service.frontend.api_server import drain, follow_readiness, open_api_server, record_api_ports
from scheduler_service.process import (
    bind_cores,
    configure_logging,
    freeze_startup_objects,
    lower_priority,
    raise_open_file_limit,
)

log = logging.getLogger("pagedserve.scheduler")


async def main(config: SchedulerServiceConfig) -> int:
    if config.api_server_count == 0 and not config.engine_core_listen:
        await run_single_process(config)
        return 0
    return await run_engine_core(config)


async def run_single_process(config: SchedulerServiceConfig) -> None:
    """--api-server-count 0: the public port and the executor pool in this one process."""
    pool = make_pool(config)
    api = await open_api_server(config, pool, config.listen)
    ports = record_api_ports(PortFile(config.port_file), api)
    stop = stop_on_signals(pool)
    log.info("scheduler listening on %s (port %d); waiting for executor %s", config.listen, api.public.port,
             ", ".join(config.executor))
    metrics_server = None
    if await start_until_stopped(pool, stop):
        if config.metrics_port is not None and pool.metrics is not None:
            pool.metrics.registry.register(api.public.generation.refusals)
        metrics_server = await start_metrics(config, pool, ports)
        await follow_readiness(api, pool)
        freeze_startup_objects()
        log.info("scheduler ready on %s", config.listen)
        await stop.wait()
    log.info("SIGTERM: refusing new requests, draining for up to %.1fs", config.shutdown_timeout)
    await drain(config, api, pool)
    await pool.stop()
    if metrics_server is not None:
        await metrics_server.close()


def run(argv: list[str] | None = None, prog: str = "python -m scheduler_service") -> int:
    configure_logging()
    config = parse_config(argv, build_parser(prog))
    raise_open_file_limit()
    lower_priority(config.cpu_nice)
    bind_cores(config.cpu_cores)
    return uvloop.run(main(config))
