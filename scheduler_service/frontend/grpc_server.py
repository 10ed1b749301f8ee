"""The public gRPC port of an api server: the Generation service (with a deserializer that never raises), health,
reflection, API keys and TLS."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.pagedserve.v1 import generation_pb2
from protos.wire import add_port, public_server_options
from scheduler_service.frontend.auth import ApiKeyInterceptor, TenantScope
from scheduler_service.frontend.generation import EngineHandle, GenerationServicer, ServingLimits
from scheduler_service.frontend.validation import parse_generate_request

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


@dataclass(slots=True)
class PublicServer:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    generation: GenerationServicer


def add_generation_servicer(servicer: GenerationServicer, server: grpc.aio.Server) -> None:
    """Like the generated add_GenerationServicer_to_server, with a deserializer that never raises."""
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=parse_generate_request,
        response_serializer=generation_pb2.GenerateResponse.SerializeToString)
    generic = grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"Generate": handler})
    server.add_generic_rpc_handlers((generic,))
    server.add_registered_method_handlers(GENERATION_SERVICE, {"Generate": handler})


async def serve(engine: EngineHandle, listen: str, max_logprobs: int, *, tokenizer_dir: str | None = None,
                credentials: grpc.ServerCredentials | None = None, api_keys: list[str] | None = None,
                serving: ServingLimits | None = None, reuse_port: bool = False, tenant_secret: bytes | None = None,
                share_prefix_cache: bool = False, server_index: int | None = None,
                refusal_listener: Callable[[str], None] | None = None) -> PublicServer:
    """The public port; with reuse_port several processes listen on it and the kernel spreads connections. With
    api_keys each key is a tenant of the prefix cache of its own (tenant_secret keys their digests; the api
    servers of one service share it), unless share_prefix_cache. server_index (an api server's, named in each
    call's initial metadata) and refusal_listener are in place before the port opens: a call that arrives while
    the rest of the server starts is answered as every later one."""
    serving = serving or ServingLimits()
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys else []
    options = [*public_server_options(serving.max_request_bytes), ("grpc.so_reuseport", 1 if reuse_port else 0)]
    server = grpc.aio.server(options=options, interceptors=interceptors)
    generation = GenerationServicer(engine, max_logprobs, tokenizer_dir, serving)
    generation.server_index = server_index
    generation.refusals.listener = refusal_listener
    if api_keys:
        generation.keys = TenantScope(tenant_secret)
        generation.share_prefix_cache = share_prefix_cache
    add_generation_servicer(generation, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = add_port(server, listen, credentials)
    for name in ("", GENERATION_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    return PublicServer(server, port, health_servicer, generation)


async def set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", GENERATION_SERVICE):
        await servicer.set(name, status)
