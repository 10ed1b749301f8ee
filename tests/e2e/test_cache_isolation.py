"""Prefix-cache isolation (#27), through real processes (simulated executor, two api servers, gRPC and HTTP).

With API keys, each key is a tenant with a prefix cache of its own: tenant B's request for a prefix tenant A sent
finds nothing cached (so B cannot time A's prompts), while A's own later requests hit, whichever api server and
transport they arrive on. vLLM's cache_salt separates further on both APIs. --enable-cross-tenant-prefix-caching
restores one cache for every key. Hits are read from the engine core's vllm:prefix_cache_hits counter, per request:
each request waits until vllm:prefix_cache_queries has counted its prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from client.lib import build_request
from executor_service.default_model.model import ensure_default_model
from protos.pagedserve.v1 import generation_pb2_grpc
from scheduler_service.frontend.generation import API_SERVER_HEADER
from tests.support.procs import Stack, running_http_stack, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ALPHA, BETA = "alpha-key", "beta-key"
BLOCK = 16


def prompt(seed: int) -> list[int]:
    """64 tokens (4 blocks): a hit covers the first 48, the block holding the last token is computed again."""
    return [1000 + seed * 64 + i for i in range(64)]


class Tenants:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.url = f"{stack.http_url}/v1"

    def counters(self) -> tuple[float, float]:
        m = self.stack.metrics()
        return m.get("vllm:prefix_cache_queries_total", 0.0), m.get("vllm:prefix_cache_hits_total", 0.0)

    def hits_of(self, send: Any) -> tuple[int, Any]:
        """Run one request (send() returns its prompt length and a result); the prompt tokens it found cached."""
        queries, hits = self.counters()
        num_prompt, result = asyncio.run(send())
        wait_until(lambda: self.counters()[0] >= queries + num_prompt, 30, "the request's prefix-cache query")
        return int(self.counters()[1] - hits), result

    def grpc(self, key: str, tokens: list[int], salt: str | None = None) -> tuple[int, str]:
        """Hits of a gRPC Generate on a fresh connection, and the api server that served it."""

        async def send() -> tuple[int, str]:
            async with grpc.aio.insecure_channel(self.stack.address) as channel:
                call = generation_pb2_grpc.GenerationStub(channel).Generate(
                    build_request(prompt_token_ids=tokens, max_tokens=2, cache_salt=salt),
                    metadata=[("authorization", f"Bearer {key}")], timeout=60)
                async for _ in call:
                    pass
                server = dict(await call.initial_metadata())[API_SERVER_HEADER]
            return len(tokens), server

        return self.hits_of(send)

    def http(self, key: str, path: str, body: dict[str, Any]) -> int:
        async def send() -> tuple[int, None]:
            async with aiohttp.ClientSession() as session, session.post(
                    f"{self.url}/{path}", json={"max_tokens": 2, **body},
                    headers={"Authorization": f"Bearer {key}"}) as response:
                answer = await response.json()
                assert response.status == 200, answer
            return answer["usage"]["prompt_tokens"], None

        return self.hits_of(send)[0]


def tenants_stack(tmp_path: Path, *flags: str) -> Iterator[Tenants]:
    scheduler = ["--api-key", ALPHA, "--api-key", BETA, "--api-server-count", "2", "--tokenizer",
                 str(ensure_default_model()), *flags]
    with running_http_stack(tmp_path, ["--simulated"], scheduler) as stack:
        yield Tenants(stack)


@pytest.fixture(scope="module")
def isolated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    yield from tenants_stack(tmp_path_factory.mktemp("isolated"))


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenants]:
    yield from tenants_stack(tmp_path_factory.mktemp("shared"), "--enable-cross-tenant-prefix-caching")


def test_a_tenant_never_hits_another_tenants_prefix_but_hits_its_own_on_any_api_server(isolated: Tenants) -> None:
    p = prompt(1)
    assert isolated.grpc(ALPHA, p)[0] == 0
    assert isolated.grpc(BETA, p)[0] == 0  # alpha's blocks are cached, but not for beta
    assert isolated.http(BETA, "completions", {"prompt": p}) == 48  # beta's own, over HTTP
    servers = set()
    for _ in range(40):  # the kernel spreads connections over the two api servers: alpha hits through both
        hit, server = isolated.grpc(ALPHA, p)
        assert hit == 48, server
        servers.add(server.split()[0])
        if len(servers) == 2:
            break
    assert servers == {"0", "1"}
    assert isolated.http(ALPHA, "completions", {"prompt": p}) == 48


def test_cache_salt_separates_requests_on_both_apis(isolated: Tenants) -> None:
    p = prompt(2)
    assert isolated.grpc(ALPHA, p, salt="s1")[0] == 0
    assert isolated.grpc(ALPHA, p)[0] == 0  # no salt is another scope
    assert isolated.http(ALPHA, "completions", {"prompt": p, "cache_salt": "s1"}) == 48
    assert isolated.grpc(ALPHA, p, salt="s2")[0] == 0
    assert isolated.grpc(BETA, p, salt="s1")[0] == 0  # the salt does not cross tenants either
    chat = {"messages": [{"role": "user", "content": "Why is the sky blue? " * 8}], "cache_salt": "c1"}
    assert isolated.http(ALPHA, "chat/completions", chat) == 0
    assert isolated.http(ALPHA, "chat/completions", chat) > 0
    assert isolated.http(ALPHA, "chat/completions", {**chat, "cache_salt": "c2"}) == 0


def test_the_cross_tenant_flag_restores_one_cache_for_every_key(shared: Tenants) -> None:
    p = prompt(3)
    assert shared.grpc(ALPHA, p)[0] == 0
    assert shared.grpc(BETA, p)[0] == 48
    assert shared.http(BETA, "completions", {"prompt": p}) == 48
    assert shared.grpc(BETA, p, salt="s")[0] == 0  # a salt still separates
