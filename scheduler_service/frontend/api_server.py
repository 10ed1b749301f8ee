"""An api server: the public gRPC port (shared with its siblings through SO_REUSEPORT) and the OpenAI HTTP API over
one GenerationServicer, and its lifecycle (open, follow the engine's readiness, drain). The same lifecycle serves
both layouts: an api server process over the engine core's socket (run_api_server), and the single-process layout
over the in-process executor pool (scheduler_service.launch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import uvloop
from grpc_health.v1 import health_pb2

from client.port_file import PortFile
from protos.wire import read_secret, server_credentials
from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.frontend.auth import load_api_keys
from scheduler_service.frontend.core_client import CoreClient, ResumeLimits
from scheduler_service.frontend.generation import EngineHandle, ServingLimits
from scheduler_service.frontend.grpc_server import PublicServer, serve, set_health
from scheduler_service.process import configure_logging, freeze_startup_objects, open_file_limit, raise_open_file_limit

if TYPE_CHECKING:
    from scheduler_service.frontend.openai.app import HttpServer

log = logging.getLogger("pagedserve.frontend")
LIVENESS = "liveness"  # a liveness probe's health name: SERVING while the event loop answers
PARENT_CHECK_S = 0.5
CALLS_CLOSE_S = 10.0  # after the engine is idle: for open calls to write their last responses


@dataclass(slots=True)
class ApiServer:
    public: PublicServer
    http: HttpServer | None
    health_updates: set[asyncio.Task[None]]


def public_credentials(config: SchedulerServiceConfig) -> grpc.ServerCredentials | None:
    if bool(config.tls_cert) != bool(config.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    return server_credentials(config.tls_cert, config.tls_key) if config.tls_cert and config.tls_key else None


def serving_limits(config: SchedulerServiceConfig) -> ServingLimits:
    return ServingLimits(max_open_calls=config.max_queue_len + config.max_num_seqs,
                         executor_wait_timeout=config.executor_wait_timeout,
                         write_timeout=config.grpc_write_timeout,
                         max_request_bytes=config.max_request_bytes)


async def start_http(config: SchedulerServiceConfig, public: PublicServer, reuse_port: bool = False
                     ) -> HttpServer | None:
    """The OpenAI-compatible HTTP API over the same GenerationServicer."""
    if not config.http_listen:
        return None
    from scheduler_service.frontend.openai.app import OpenAIApi, serve_http
    from scheduler_service.frontend.openai.connections import HttpLimits, connection_cap

    api = OpenAIApi(public.generation, config.served_model_name,
                    load_api_keys(config.api_key, config.api_key_file), config.tokenizer, config.tool_call_parser)
    limits = HttpLimits(config.http_header_timeout, config.http_body_timeout, config.http_timeout_keep_alive,
                        config.http_max_connections, config.http_write_timeout, config.http_send_buffer)
    files = open_file_limit()
    cap = connection_cap(config.http_max_connections, files)
    if cap < config.http_max_connections:
        log.warning("--http-max-connections %d lowered to %d: half this process's open-file limit %d, so that "
                    "the HTTP port cannot take the descriptors gRPC needs", config.http_max_connections, cap, files)
    http = await serve_http(api, config.http_listen, config.tls_cert, config.tls_key, reuse_port, limits, cap)
    log.info("OpenAI-compatible HTTP API on %s (port %d): at most %d connections, headers within %gs, bodies "
             "within %gs, idle connections closed after %gs, responses unread for %gs dropped", config.http_listen,
             http.port, cap, limits.header_timeout, limits.body_timeout, limits.keep_alive_timeout,
             limits.write_timeout)
    return http


async def open_api_server(config: SchedulerServiceConfig, engine: EngineHandle, listen: str, *,
                          reuse_port: bool = False, tenant_secret: bytes | None = None,
                          server_index: int | None = None, refusal_listener: Callable[[str], None] | None = None
                          ) -> ApiServer:
    """The gRPC port and the HTTP API, NOT_SERVING until follow_readiness sees the engine ready. tenant_secret
    keys the API keys' prefix-cache tenants (the same in every api server of the service; random if None);
    server_index and refusal_listener as serve's."""
    public = await serve(engine, listen, config.max_logprobs, tokenizer_dir=config.tokenizer,
                         credentials=public_credentials(config),
                         api_keys=load_api_keys(config.api_key, config.api_key_file),
                         serving=serving_limits(config), reuse_port=reuse_port, tenant_secret=tenant_secret,
                         share_prefix_cache=config.enable_cross_tenant_prefix_caching, server_index=server_index,
                         refusal_listener=refusal_listener)
    await public.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    http = await start_http(config, public, reuse_port)
    return ApiServer(public, http, set())


def record_api_ports(ports: PortFile, api: ApiServer) -> PortFile:
    """The public gRPC port and the HTTP port (if any) into --port-file."""
    ports.record("listen", api.public.port)
    if api.http is not None:
        ports.record("http_listen", api.http.port)
    return ports


async def follow_readiness(api: ApiServer, engine: EngineHandle) -> None:
    """Health SERVING while the engine has an executor (and this server is not draining)."""

    def on_ready_change(ready: bool) -> None:
        task = asyncio.ensure_future(set_health(api.public.health,
                                                ready and not api.public.generation.shutting_down))
        api.health_updates.add(task)
        task.add_done_callback(api.health_updates.discard)

    engine.on_ready_change = on_ready_change
    if engine.ready.is_set():
        await set_health(api.public.health, True)


async def calls_closed(api: ApiServer, timeout: float) -> None:
    """Wait (up to timeout) for every call to have written its last response: a stream the engine has finished
    may still be sending to a slow client, and stopping the server would cancel it."""
    deadline = asyncio.get_running_loop().time() + timeout
    while api.public.generation.open_calls and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


async def drain(config: SchedulerServiceConfig, api: ApiServer, engine: EngineHandle) -> None:
    """Refuse new calls (health NOT_SERVING), let open streams finish for up to --shutdown-timeout, abort the rest,
    close the ports."""
    api.public.generation.shutting_down = True
    await set_health(api.public.health, False)
    if not engine.idle():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(engine.wait_idle(), timeout=config.shutdown_timeout)
    aborted = engine.abort_all(f"server shut down after --shutdown-timeout {config.shutdown_timeout}s")
    log.info("drained; aborted %d unfinished requests", aborted)
    await calls_closed(api, CALLS_CLOSE_S)
    await api.public.server.stop(grace=2.0)
    if api.http is not None:
        await api.http.stop()


def run_api_server(config: SchedulerServiceConfig, index: int, identity: bytes, core_address: str,
                   listen: str, tenant_secret: bytes | None = None, core_pid: int | None = None) -> None:
    """Entry point of an api server process (started by the engine core with multiprocessing spawn, which hands
    it the service's tenant_secret through its pipe, not its command line or environment). core_pid: the engine
    core's pid as the core saw it (os.getppid() here would be the new parent's if the core died while this
    process started, and the api server would then never notice it gone)."""
    configure_logging(f"[api-server {index}]")
    raise_open_file_limit()  # inherited from the engine core already: this logs it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the core decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # meant for the core (re-read its executors)
    parent = core_pid if core_pid is not None else os.getppid()
    uvloop.run(serve_engine_core(config, index, identity, core_address, listen, tenant_secret, parent))


def core_client(config: SchedulerServiceConfig, identity: bytes, core_address: str) -> CoreClient:
    limits = ResumeLimits(read_secret(config.engine_core_secret_file), config.engine_core_timeout,
                          config.engine_core_wait_timeout)
    return CoreClient(core_address, identity, config.max_stream_buffer, limits)


async def serve_engine_core(config: SchedulerServiceConfig, index: int, identity: bytes, core_address: str,
                            listen: str, tenant_secret: bytes | None = None, core_pid: int | None = None
                            ) -> None:
    core = core_client(config, identity, core_address)
    await core.start()
    api = await open_api_server(config, core, listen, reuse_port=True, tenant_secret=tenant_secret,
                                server_index=index, refusal_listener=core.count_refusal)
    await follow_readiness(api, core)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    watcher = asyncio.create_task(watch_parent(core_pid if core_pid is not None else os.getppid(), stop))
    freeze_startup_objects()
    log.info("api server %d (pid %d) serving %s", index, os.getpid(), listen)
    await stop.wait()
    watcher.cancel()
    await drain(config, api, core)
    with contextlib.suppress(Exception):
        await core.close()


async def watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("engine core (pid %d) is gone; this api server exits", parent)
    os._exit(1)
