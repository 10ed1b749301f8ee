"""A front-end process: the public gRPC port (shared with its siblings through SO_REUSEPORT), validation,
tokenization, detokenization, stop strings, n > 1 fan-out and streaming, over the engine core's socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal

import uvloop
from grpc_health.v1 import health_pb2

from scheduler_service.config import SchedulerServiceConfig
from scheduler_service.frontend.auth import load_api_keys
from scheduler_service.frontend.core_client import CoreClient
from scheduler_service.frontend.generation import PublicServer, serve, set_health

log = logging.getLogger("pagedserve.frontend")
PARENT_CHECK_S = 0.5


def run_frontend(config: SchedulerServiceConfig, index: int, identity: bytes, core_address: str,
                 listen: str) -> None:
    """Entry point of a front-end process (started by the engine core with multiprocessing spawn)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s[api-server {index}]: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the core decides
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # meant for the core (re-read its executors)
    uvloop.run(main(config, index, identity, core_address, listen))


async def main(config: SchedulerServiceConfig, index: int, identity: bytes, core_address: str,
               listen: str) -> None:
    from scheduler_service.launch import LIVENESS, credentials, freeze_startup_objects, serving_limits, start_http

    public_creds, _ = credentials(config)
    core = CoreClient(core_address, identity, config.max_stream_buffer)
    await core.start()
    public = await serve(core, listen, config.max_logprobs, tokenizer_dir=config.tokenizer,
                         credentials=public_creds, api_keys=load_api_keys(config.api_key, config.api_key_file),
                         serving=serving_limits(config), reuse_port=True)
    public.generation.server_index = index
    public.generation.refusals.listener = core.count_refusal
    await public.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    http = await start_http(config, public, reuse_port=True)
    health_updates: set[asyncio.Task[None]] = set()

    def on_ready_change(ready: bool) -> None:
        task = asyncio.ensure_future(set_health(public.health, ready and not public.generation.shutting_down))
        health_updates.add(task)
        task.add_done_callback(health_updates.discard)

    core.on_ready_change = on_ready_change
    if core.ready.is_set():
        await set_health(public.health, True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    watcher = asyncio.create_task(watch_parent(os.getppid(), stop))
    freeze_startup_objects()
    log.info("api server %d (pid %d) serving %s", index, os.getpid(), listen)
    await stop.wait()
    watcher.cancel()
    await drain(config, public, core)
    if http is not None:
        await http.stop()


async def watch_parent(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_S)
    log.error("engine core (pid %d) is gone; this api server exits", parent)
    os._exit(1)


async def drain(config: SchedulerServiceConfig, public: PublicServer, core: CoreClient) -> None:
    public.generation.shutting_down = True
    await set_health(public.health, False)
    deadline = asyncio.get_running_loop().time() + config.shutdown_timeout
    while core.streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)
    aborted = core.abort_all(f"server shut down after --shutdown-timeout {config.shutdown_timeout}s")
    log.info("drained; aborted %d unfinished requests", aborted)
    await public.server.stop(grace=2.0)
    with contextlib.suppress(Exception):
        await core.close()
