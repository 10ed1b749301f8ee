"""The public gRPC port answers its first call as every later one: an api server's index (the pagedserve-api-server
initial metadata) and the engine core's refusal counter are in place when the port opens. They used to be set after
serve() returned, past the health and HTTP starts, so a call the kernel handed a starting api server (two of them
share the port) went out without its server's name (a CI failure of test_cache_isolation) and its refusal went
uncounted at the engine core. A real grpc.aio server on 127.0.0.1 and a real client; the engine has no executor."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc

from client.lib import build_request
from protos.pagedserve.v1 import generation_pb2_grpc
from scheduler_service.frontend.generation import API_SERVER_HEADER, ServingLimits
from scheduler_service.frontend.grpc_server import serve


class EngineWithoutExecutor:
    """An engine handle whose executor never connects: every call waits --executor-wait-timeout, then is refused."""

    describe = None
    metrics_model_name = None
    on_ready_change = None

    def __init__(self) -> None:
        self.ready = asyncio.Event()

    def add(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no request may reach an engine without an executor")


async def test_the_first_call_names_its_api_server_and_its_refusal_reaches_the_listener() -> None:
    refused: list[str] = []
    public = await serve(EngineWithoutExecutor(), "127.0.0.1:0", 8,  # type: ignore[arg-type]
                         serving=ServingLimits(executor_wait_timeout=0.05), server_index=3,
                         refusal_listener=refused.append)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{public.port}") as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(
                build_request(prompt_token_ids=[1, 2, 3], max_tokens=1), timeout=30)
            metadata = dict(await call.initial_metadata())
            assert await call.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await public.server.stop(grace=None)
    assert metadata[API_SERVER_HEADER] == f"3 {os.getpid()}"
    assert refused == ["UNAVAILABLE"]
