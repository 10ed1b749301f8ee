"""Async client library: `async for response in client.generate(...)`. With resume_attempts, a stream that breaks
(its front-end died or is draining) is continued on the same address (any front-end behind it) from the tokens
already received, with back-off: the caller sees a pause, no error and no token twice (#28)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from protos.wire import channel_credentials, open_channel

SAMPLING_FIELDS = frozenset(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                       grpc.StatusCode.CANCELLED})  # CANCELLED: by a stopping server (the caller's own: CancelledError)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.1, 2.0


def backoff(attempt: int) -> float:
    """Seconds before resume attempt `attempt` (1, 2, ...): doubling from 0.1 s up to 2 s, with jitter."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class ResumeState:
    """What a client has of a call: tokens per sequence, the sequences it has whole."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finished: set[int] = set()

    def take(self, response: generation_pb2.GenerateResponse) -> None:
        self.tokens.setdefault(response.index, []).extend(response.token_ids)
        if response.finish_reason:
            self.finished.add(response.index)

    def complete(self, request: generation_pb2.GenerateRequest) -> bool:
        n = request.sampling.n if request.sampling.HasField("n") else 1
        return len(self.finished) >= n

    def point(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateRequest:
        """The request again with its resume point."""
        resumed = generation_pb2.GenerateRequest()
        resumed.CopyFrom(request)
        del resumed.resume[:]
        for index in sorted(self.tokens.keys() | self.finished):
            resumed.resume.add(index=index, token_ids=self.tokens.get(index, []), finished=index in self.finished)
        return resumed


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
                 tls: bool = False, credentials: grpc.ChannelCredentials | None = None,
                 resume_attempts: int = 0) -> None:
        """resume_attempts: how many times in a row a broken stream is resumed (0: never; the error is raised)."""
        self.resume_attempts = resume_attempts
        self.num_resumed = 0  # streams resumed, over this client's life
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
        if self.resume_attempts and not request.request_id:
            request.request_id = uuid.uuid4().hex  # a resumed call names the call it continues
        state = ResumeState()
        first = request
        failures = 0
        while True:
            call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
            try:
                async for response in call:
                    state.take(response)
                    failures = 0
                    yield response
                return
            except grpc.aio.AioRpcError as e:
                if self.resume_attempts and state.complete(request):
                    return  # every sequence had its last response; only the call's closing status was lost
                if failures >= self.resume_attempts or not self._resumable(e.code(), request is not first):
                    raise
            finally:
                call.cancel()
            failures += 1
            self.num_resumed += 1
            await asyncio.sleep(backoff(failures))
            request = state.point(request)

    @staticmethod
    def _resumable(code: grpc.StatusCode, retrying: bool) -> bool:
        """A broken or refused-for-now stream; ALREADY_EXISTS too once retrying (the core has not yet dropped the
        lost front-end's copy of a sequence that had no token)."""
        return code in RESUMABLE or (retrying and code is grpc.StatusCode.ALREADY_EXISTS)

    async def health(self, service: str = "", timeout: float = 5.0) -> bool:
        response = await self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return response.status == health_pb2.HealthCheckResponse.SERVING
