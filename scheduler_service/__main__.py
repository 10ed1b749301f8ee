"""python -m scheduler_service --listen HOST:PORT --executor HOST:PORT ..."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop

from scheduler_service.config import SchedulerServiceConfig, parse_config
from scheduler_service.engine import Engine
from scheduler_service.server import serve, set_health

log = logging.getLogger("pagedserve.scheduler")


async def main(config: SchedulerServiceConfig) -> None:
    engine = Engine(config.core(), config.executor[0], config.max_queue_len, config.served_model_name)
    server, port, health_servicer = await serve(engine, config.listen, config.max_logprobs)
    log.info("scheduler listening on %s (port %d); waiting for executor %s", config.listen, port,
             config.executor[0])
    await engine.start()
    if config.metrics_port is not None and engine.metrics is not None:
        engine.metrics.serve(config.metrics_host, config.metrics_port)
        log.info("metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
    engine.on_ready_change = lambda ready: asyncio.ensure_future(set_health(health_servicer, ready))
    await set_health(health_servicer, True)
    log.info("scheduler ready on %s", config.listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=2.0)
    await engine.stop()


def run(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(main(parse_config(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(run())
