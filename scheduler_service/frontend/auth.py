"""API keys on the public port, checked by a server interceptor; the tenant a key stands for in the prefix cache."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from protos.wire import OPEN_METHOD_PREFIXES, unauthenticated

REFUSAL = "missing or invalid API key (send metadata 'authorization: Bearer KEY')"


def load_api_keys(keys: list[str] | None, key_file: str | None) -> list[str]:
    found = [k for k in keys or [] if k]
    if key_file:
        lines = Path(key_file).read_text().splitlines()
        found += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return found


def presented_key(metadata: tuple[tuple[str, str | bytes], ...] | None) -> str:
    """The API key a gRPC call presents (authorization: Bearer KEY, or x-api-key), or ""."""
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
        if details.method.startswith(OPEN_METHOD_PREFIXES) or self._valid(presented_key(details.invocation_metadata)):
            return await continuation(details)
        handler = await continuation(details)
        return None if handler is None else unauthenticated(handler, REFUSAL)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the engine core may know it. owner: its API key's digest ("" without keys), which
    scopes its request ids, so two keys never see or replace each other's requests; tenant: its prefix-cache
    scope (the same digest, or "" when the cache is shared across keys)."""

    owner: str = ""
    tenant: str = ""

    def scoped_id(self, request_id: str) -> str:
        """The id the engine core knows this caller's request_id by (the caller's id itself without keys)."""
        return f"{self.owner[:16]}:{request_id}" if self.owner else request_id


ANONYMOUS = Caller()


class TenantScope:
    """Who a caller is to the prefix cache: HMAC-SHA256 of its API key under a secret the api servers of one
    service share, as 32 hex digits. With --engine-core-secret-file the secret is derived from the link secret
    (link_auth.tenant_key), so every front-end of a deployment, standalone or a core's child, computes the same
    digest; without it the engine core draws one at start for its own api servers. The key itself
    never leaves the api server, and its digest is useless outside this deployment. Requests of
    different tenants never share cached blocks (scheduler_service/core/block_hash.py)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else os.urandom(32)

    def of(self, key: str) -> str:
        if not key:
            return ""
        return hmac.new(self._secret, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]
