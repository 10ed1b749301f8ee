"""Async client library: `async for response in client.generate(...)`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from protos.wire import channel_credentials, open_channel

SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def build_request(prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                  request_id: str = "", output_len_hint: int | None = None, cache_salt: str | None = None,
                  **sampling: Any) -> generation_pb2.GenerateRequest:
    unknown = set(sampling) - SAMPLING_FIELDS
    if unknown:
        raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
    params = common_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    req = generation_pb2.GenerateRequest(request_id=request_id, prompt=prompt or "",
                                         prompt_token_ids=prompt_token_ids or [], sampling=params)
    if output_len_hint is not None:
        req.output_len_hint = output_len_hint
    if cache_salt is not None:
        req.cache_salt = cache_salt
    return req


class PagedServeClient:
    def __init__(self, server: str, *, api_key: str | None = None, tls_ca: str | None = None,
                 tls: bool = False, credentials: grpc.ChannelCredentials | None = None) -> None:
        if credentials is None and (tls or tls_ca):
            credentials = channel_credentials(tls_ca)
        self._channel = open_channel(server, credentials)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    async def __aenter__(self) -> PagedServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def generate(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None, *,
                       timeout: float | None = None, **kwargs: Any
                       ) -> AsyncGenerator[generation_pb2.GenerateResponse]:
        request = build_request(prompt, prompt_token_ids, **kwargs)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()

    async def health(self, service: str = "", timeout: float = 5.0) -> bool:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING
