"""The executor port's shared secret (--executor-secret-file), checked by a server interceptor."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from protos.wire import EXECUTOR_SECRET_METADATA_KEY

SECRET_METADATA_KEY = EXECUTOR_SECRET_METADATA_KEY
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
log = logging.getLogger("pagedserve.executor")
REFUSAL = f"missing or wrong executor secret (metadata {SECRET_METADATA_KEY!r}; see --executor-secret-file)"


def load_or_create_secret(path: str | None) -> str | None:
    """The secret in `path`; a file that does not exist yet is created with a random secret (mode 0600),
    for the scheduler to read: compose shares it through a volume."""
    if not path:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("generated a new executor secret in %s", path)
    secret = Path(path).read_text().strip()
    if not secret:
        raise SystemExit(f"secret file {path} is empty")
    return secret


def presented_secret(metadata: tuple[tuple[str, str | bytes], ...] | None) -> bytes:
    for name, value in metadata or ():
        if name == SECRET_METADATA_KEY and isinstance(value, str):
            return value.encode()
    return b""


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses Describe and Execute without the secret (UNAUTHENTICATED); health and reflection stay open."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        if hmac.compare_digest(presented_secret(details.invocation_metadata), self._secret):
            return handler
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)
        yield  # pragma: no cover - makes this an async generator

    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                     handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(deny_unary, handler.request_deserializer,
                                               handler.response_serializer)
