"""The engine core process: the executor pool, the api servers' socket, and the api server processes it supervises.
Also what the single-process layout shares with it: building the pool, signals, and starting until stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

import grpc

from client.port_file import PortFile
from protos.wire import channel_credentials, read_secret
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.engine.api_servers import ApiServers
from scheduler_service.engine.engine_core import EngineCore
from scheduler_service.engine.executor_loop import ExecutorLoop
from scheduler_service.engine.metrics import EngineMetrics, MetricsServer
from scheduler_service.engine.pool import ExecutorPool, PoolConfig
from scheduler_service.link_auth import check_address
from scheduler_service.messages import clear_stale_ipc_files, ipc_address
from scheduler_service.process import freeze_startup_objects

log = logging.getLogger("pagedserve.scheduler")


def executor_credentials(config: SchedulerServiceConfig) -> grpc.ChannelCredentials | None:
    return channel_credentials(config.tls_ca, config.tls_cert, config.tls_key) if config.tls_ca else None


def make_pool(config: SchedulerServiceConfig) -> ExecutorPool:
    pool_config = PoolConfig(config.executor, config.executor_resolve_interval, config.executor_hosts_file,
                             config.executor_drain_file)
    secret = read_secret(config.executor_secret_file)
    creds = executor_credentials(config)

    def make_loop(address: str, metrics: EngineMetrics | None) -> ExecutorLoop:
        return ExecutorLoop(config.core(), address, config.max_queue_len, config.served_model_name, creds,
                            config.executor_step_timeout, executor_wait_timeout=config.executor_wait_timeout,
                            executor_secret=secret, metrics=metrics, steps_in_flight=config.steps_in_flight,
                            grammar_compile_timeout=config.structured_outputs_compile_timeout)

    return ExecutorPool(pool_config, config.core(), config.max_queue_len, make_loop, config.served_model_name)


def reserve_listen(listen: str) -> tuple[str, socket.socket | None]:
    """Api servers share one port: a requested port 0 is bound here, once, with SO_REUSEPORT, and the socket held
    (bound, never listening, so it takes no connection) while they run, so that no other process can take the port
    before they bind it too. The address with its port, and the socket to close after them (None: a fixed port)."""
    host, _, port = listen.rpartition(":")
    if port != "0":
        return listen, None
    bare = host.strip("[]")
    s = socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((bare or "0.0.0.0", 0))
    except OSError:
        s.close()
        raise
    return f"{host}:{s.getsockname()[1]}", s


def stop_on_signals(pool: ExecutorPool) -> asyncio.Event:
    """SIGINT/SIGTERM set the returned event; SIGHUP re-resolves the executors. Installed before the
    process says it is waiting for an executor, so a signal sent on that line is never the default kill."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, pool.refresh_soon)
    return stop


async def start_until_stopped(pool: ExecutorPool, stop: asyncio.Event) -> bool:
    """Start the pool until it has an executor or `stop` is set first (then the start is cancelled).
    Whether the pool started."""
    starting = asyncio.create_task(pool.start())
    await asyncio.wait([starting, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        return False
    starting.result()
    return True


async def start_metrics(config: SchedulerServiceConfig, pool: ExecutorPool, ports: PortFile) -> MetricsServer | None:
    if config.metrics_port is None or pool.metrics is None:
        return None
    server = MetricsServer(pool.metrics.registry)
    port = await server.start(config.metrics_host, config.metrics_port)
    ports.record("metrics_port", port)
    log.info("metrics on http://%s:%d/metrics", config.metrics_host, port)
    return server


async def run_engine_core(config: SchedulerServiceConfig) -> int:
    """The engine core process: the executor pool, the api servers' socket, and the api server processes. Its
    socket file is removed on every way out but SIGKILL; the next start removes those of killed processes."""
    stale = clear_stale_ipc_files()
    if stale:
        log.info("removed %d stale ipc socket files of exited pagedserve processes", len(stale))
    pool = make_pool(config)
    secret = read_secret(config.engine_core_secret_file)
    if config.engine_core_listen:
        check_address(config.engine_core_listen, secret, "--engine-core-listen")
    core = EngineCore(pool, config.engine_core_listen or ipc_address("core"), secret, config.engine_core_timeout)
    try:
        core.bind()
    except Exception as e:
        core.close()
        raise SystemExit(f"--engine-core-listen {config.engine_core_listen}: {e}") from None
    log.info("engine core (pid %d) listening for front-ends on %s%s", os.getpid(), core.address,
             " (CURVE)" if secret else "")
    ports = PortFile(config.port_file)
    if core.address.startswith("tcp://"):
        ports.record("engine_core_listen", int(core.address.rpartition(":")[2]))
    try:
        await serve_engine_core(config, pool, core, ports)
    finally:
        core.close()
    return 0


def reserve_ports(config: SchedulerServiceConfig, ports: PortFile) -> tuple[str, list[socket.socket]]:
    """The api servers' gRPC address and config.http_listen with their ports fixed (reserve_listen), recorded in
    the port file; and the reserving sockets, to close once the api servers are stopped. (No api server: none.)"""
    if not config.api_server_count:
        return config.listen, []
    listen, held = reserve_listen(config.listen)
    sockets = [held] if held is not None else []
    ports.record("listen", int(listen.rpartition(":")[2]))
    if config.http_listen:
        config.http_listen, held = reserve_listen(config.http_listen)
        sockets += [held] if held is not None else []
        ports.record("http_listen", int(config.http_listen.rpartition(":")[2]))
    return listen, sockets


async def serve_engine_core(config: SchedulerServiceConfig, pool: ExecutorPool, core: EngineCore,
                            ports: PortFile) -> None:
    core.start()
    listen, reserved = reserve_ports(config, ports)
    servers = ApiServers(config, core.address, listen, core.drop_frontend)
    servers.start()
    metrics_server: MetricsServer | None = None
    try:
        pool.on_ready_change = lambda ready: core.broadcast_status()
        stop = stop_on_signals(pool)
        log.info("engine core (pid %d) started %d api servers on %s; waiting for executor %s", os.getpid(),
                 config.api_server_count, listen, ", ".join(config.executor))
        if await start_until_stopped(pool, stop):
            core.broadcast_status()
            if config.metrics_port is not None and pool.metrics is not None:
                core.counters()  # its series on the registry from the start
            metrics_server = await start_metrics(config, pool, ports)
            freeze_startup_objects()
            log.info("engine core ready; %s", f"api servers on {listen}" if config.api_server_count
                     else f"front-ends connect to {core.address}")
            await stop.wait()
            handed = core.hand_back(servers.names())
            log.info("SIGTERM: handed %d requests back to front-ends of their own (they resume them on the "
                     "restarted core); api servers drain for up to %.1fs", handed, config.shutdown_timeout)
            await servers.drain(config.shutdown_timeout + 5.0)
    finally:
        servers.kill()
        for held in reserved:
            held.close()
        aborted = pool.abort_all("server shut down")
        log.info("api servers stopped; aborted %d requests left in the core", aborted)
        await pool.stop()
        if metrics_server is not None:
            await metrics_server.close()
