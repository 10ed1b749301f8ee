"""python -m scheduler_service --listen HOST:PORT --executor HOST:PORT ..."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

import grpc
import uvloop
from grpc_health.v1 import health_pb2

from protos.wire import channel_credentials, read_secret, server_credentials
from scheduler_service.config import SchedulerServiceConfig, parse_config
from scheduler_service.engine.api_servers import ApiServers
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.executor_loop import Engine
from scheduler_service.engine.metrics import EngineMetrics, MetricsServer
from scheduler_service.engine.pool import ExecutorPool, PoolConfig
from scheduler_service.frontend.auth import load_api_keys
from scheduler_service.frontend.generation import PublicServer, ServingLimits, serve, set_health
from scheduler_service.messages import ipc_address

if TYPE_CHECKING:
    from scheduler_service.frontend.openai.app import HttpServer

log = logging.getLogger("pagedserve.scheduler")
LIVENESS = "liveness"


def credentials(config: SchedulerServiceConfig) -> tuple[grpc.ServerCredentials | None,
                                                        grpc.ChannelCredentials | None]:
    if bool(config.tls_cert) != bool(config.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    public = server_credentials(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None
    to_executor = (channel_credentials(config.tls_ca, config.tls_cert, config.tls_key) if config.tls_ca
                   else None)
    return public, to_executor


def freeze_startup_objects() -> None:
    """Keep start-up objects out of the collector's way and collect the young generation less often:
    the engine loop allocates many short-lived objects per step."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 1000)


async def start_http(config: SchedulerServiceConfig, public: PublicServer, reuse_port: bool = False
                     ) -> HttpServer | None:
    """The OpenAI-compatible HTTP API over the same GenerationServicer (in every api server process)."""
    if not config.http_listen:
        return None
    from scheduler_service.frontend.openai.app import OpenAIApi, serve_http

    api = OpenAIApi(public.generation, config.served_model_name,
                    load_api_keys(config.api_key, config.api_key_file), config.tokenizer)
    http = await serve_http(api, config.http_listen, config.tls_cert, config.tls_key, reuse_port)
    log.info("OpenAI-compatible HTTP API on %s (port %d)", config.http_listen, http.port)
    return http


async def shutdown(config: SchedulerServiceConfig, public: PublicServer, engine: ExecutorPool) -> None:
    log.info("SIGTERM: refusing new requests, draining for up to %.1fs", config.shutdown_timeout)
    public.generation.shutting_down = True
    await set_health(public.health, False)
    if not engine.idle():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.wait_idle(), timeout=config.shutdown_timeout)
    aborted = engine.abort_all(f"server shut down after --shutdown-timeout {config.shutdown_timeout}s")
    log.info("drained; aborted %d unfinished requests", aborted)
    await public.server.stop(grace=2.0)
    await engine.stop()


async def main(config: SchedulerServiceConfig) -> int:
    if config.api_server_count == 0:
        await main_single_process(config)
        return 0
    return await main_core(config)


def make_pool(config: SchedulerServiceConfig, executor_creds: grpc.ChannelCredentials | None) -> ExecutorPool:
    pool_config = PoolConfig(config.executor, config.executor_resolve_interval, config.executor_hosts_file,
                             config.executor_drain_file)
    secret = read_secret(config.executor_secret_file)

    def make_engine(address: str, metrics: EngineMetrics | None) -> Engine:
        return Engine(config.core(), address, config.max_queue_len, config.served_model_name, executor_creds,
                      config.executor_step_timeout, executor_wait_timeout=config.executor_wait_timeout,
                      executor_secret=secret, metrics=metrics, steps_in_flight=config.steps_in_flight)

    return ExecutorPool(pool_config, config.core(), config.max_queue_len, make_engine, config.served_model_name)


def serving_limits(config: SchedulerServiceConfig) -> ServingLimits:
    return ServingLimits(max_open_calls=config.max_queue_len + config.max_num_seqs,
                         executor_wait_timeout=config.executor_wait_timeout,
                         max_request_bytes=config.max_request_bytes)


def resolve_listen(listen: str) -> str:
    """Api servers share one port: a requested port 0 is fixed here, once, for all of them."""
    host, _, port = listen.rpartition(":")
    if port != "0":
        return listen
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
        s.bind((host.strip("[]") or "0.0.0.0", 0))
        return f"{host}:{s.getsockname()[1]}"


def stop_on_signals(engine: ExecutorPool) -> asyncio.Event:
    """SIGINT/SIGTERM set the returned event; SIGHUP re-resolves the executors. Installed before the
    process says it is waiting for an executor, so a signal sent on that line is never the default kill."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, engine.refresh_soon)
    return stop


async def start_until_stopped(engine: ExecutorPool, stop: asyncio.Event) -> bool:
    """Start the pool until it has an executor or `stop` is set first (then the start is cancelled).
    Whether the pool started."""
    starting = asyncio.create_task(engine.start())
    await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        return False
    starting.result()
    return True


async def main_core(config: SchedulerServiceConfig) -> int:
    """The engine core process: the executor pool, the api servers' socket, and the api server processes."""
    _, executor_creds = credentials(config)
    engine = make_pool(config, executor_creds)
    core = EngineCore(engine, ipc_address("core"))
    core.bind()
    core.start()
    listen = resolve_listen(config.listen)
    if config.http_listen:
        config.http_listen = resolve_listen(config.http_listen)
    servers = ApiServers(config, core.address, listen, core.drop_frontend)
    servers.start()
    engine.on_ready_change = lambda ready: core.broadcast_status()
    stop = stop_on_signals(engine)
    log.info("engine core (pid %d) started %d api servers on %s; waiting for executor %s", os.getpid(),
             config.api_server_count, listen, ", ".join(config.executor))
    started = await start_until_stopped(engine, stop)
    metrics_server: MetricsServer | None = None
    if started:
        core.broadcast_status()
        if config.metrics_port is not None and engine.metrics is not None:
            core.counters()  # its series on the registry from the start
            metrics_server = MetricsServer(engine.metrics.registry)
            await metrics_server.start(config.metrics_host, config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
        freeze_startup_objects()
        log.info("engine core ready; api servers on %s", listen)
        await stop.wait()
        log.info("SIGTERM: api servers drain for up to %.1fs", config.shutdown_timeout)
        await servers.drain(config.shutdown_timeout + 5.0)
    servers.kill()
    aborted = engine.abort_all("server shut down")
    log.info("api servers stopped; aborted %d requests left in the core", aborted)
    await engine.stop()
    core.close()
    if metrics_server is not None:
        await metrics_server.close()
    return 0


async def main_single_process(config: SchedulerServiceConfig) -> None:
    """--api-server-count 0: the public port and the engine loop in this one process."""
    public_creds, executor_creds = credentials(config)
    engine = make_pool(config, executor_creds)
    serving = serving_limits(config)
    public = await serve(engine, config.listen, config.max_logprobs, tokenizer_dir=config.tokenizer,
                         credentials=public_creds, api_keys=load_api_keys(config.api_key, config.api_key_file),
                         serving=serving)
    # A liveness probe's health name: SERVING while the event loop answers, with or without executors.
    await public.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    stop = stop_on_signals(engine)
    log.info("scheduler listening on %s (port %d); waiting for executor %s", config.listen, public.port,
             ", ".join(config.executor))
    http = await start_http(config, public)
    started = await start_until_stopped(engine, stop)
    metrics_server: MetricsServer | None = None
    if started:
        if config.metrics_port is not None and engine.metrics is not None:
            engine.metrics.registry.register(public.generation.refusals)
            metrics_server = MetricsServer(engine.metrics.registry)
            await metrics_server.start(config.metrics_host, config.metrics_port)
            log.info("metrics on http://%s:%d/metrics", config.metrics_host, config.metrics_port)
        health_updates: set[asyncio.Task[None]] = set()

        def on_ready_change(ready: bool) -> None:
            task = asyncio.ensure_future(set_health(public.health, ready))
            health_updates.add(task)
            task.add_done_callback(health_updates.discard)

        engine.on_ready_change = on_ready_change
        await set_health(public.health, True)
        freeze_startup_objects()
        log.info("scheduler ready on %s", config.listen)
        await stop.wait()
    await shutdown(config, public, engine)
    if http is not None:
        await http.stop()
    if metrics_server is not None:
        await metrics_server.close()


def run(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return uvloop.run(main(parse_config(argv)))


if __name__ == "__main__":
    sys.exit(run())
