"""API keys on the public port, checked by a server interceptor."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[str]:
    found = [k for k in keys or [] if k]
    if key_file:
        lines = Path(key_file).read_text().splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return found


def _presented_key(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    for name, value in metadata or ():
        if name not in ("authorization", "x-api-key") or isinstance(value, bytes):
            continue
        if name == "x-api-key":
            return value.strip()
        if value.lower().startswith("bearer "):
            return value[7:].strip()
    return ""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid key with UNAUTHENTICATED; health and reflection stay open."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = [k.encode() for k in keys]

    def _valid(self, key: str) -> bool:
        return any(hmac.compare_digest(key.encode(), k) for k in self._keys)

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(OPEN_METHOD_PREFIXES) or self._valid(_presented_key(details.invocation_metadata)):
            return await continuation(details)
        return _refusal(await continuation(details))


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    if handler is None:
        return None

    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                            "(send metadata 'authorization: Bearer KEY')")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await deny_unary(request, context)
        yield  # pragma: no cover - makes this an async generator

    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer,
                                               handler.response_serializer)
