"""API-key tenants across standalone front-ends (#28): with --engine-core-secret-file every front-end derives the
same tenant-digest key from the link secret, so one API key is one tenant on all of them: a prefix one front-end's
caller left in the cache is a hit on the other, and a call resumed on the other front-end supersedes its copy still
held for the first (the core matches id and tenant)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.lib import PagedServeClient, ResumeState, build_request
from client.local import wait_healthy, wait_until
from scheduler_service.link_auth import tenant_key
from tests.support.streams import EXECUTOR
from tests.support.tiers import Tiers, running_tiers

KEY = "tenant-key"
PROMPT = [2000 + i for i in range(64)]  # 4 blocks of 16: a hit covers the first 48


def link_args(tmp_path: Path) -> list[str]:
    secret = tmp_path / "link.secret"
    secret.write_text("the deployment's link secret\n")
    return ["--engine-core-secret-file", str(secret)]


async def prompt_hits(tiers: Tiers, address: str) -> int:
    """The prompt tokens a call with KEY on `address` found cached (read from the core's counters)."""
    queries = tiers.metrics().get("vllm:prefix_cache_queries_total", 0.0)
    hits = tiers.metrics().get("vllm:prefix_cache_hits_total", 0.0)
    async with PagedServeClient(address, api_key=KEY) as client:
        async for _ in client.generate(prompt_token_ids=PROMPT, max_tokens=2, timeout=60):
            pass
    counted = queries + len(PROMPT)
    await asyncio.to_thread(wait_until, lambda: tiers.metrics().get("vllm:prefix_cache_queries_total", 0.0)
                            >= counted, 30, "the call's prefix-cache query")
    return int(tiers.metrics().get("vllm:prefix_cache_hits_total", 0.0) - hits)


async def resume_elsewhere(first: str, other: str, i: int) -> None:
    """A seeded call broken off on `first` and resumed on `other` with the same key continues exactly."""
    params = {"prompt_token_ids": [7, 8, 9], "max_tokens": 60, "ignore_eos": True, "temperature": 1.0}
    request = build_request(request_id=f"t{i}", seed=i, **params)  # type: ignore[arg-type]
    async with PagedServeClient(first, api_key=KEY) as a, PagedServeClient(other, api_key=KEY) as b:
        state = ResumeState()
        call = a._stub.Generate(request, timeout=60, metadata=a._metadata)
        async for r in call:
            state.take(r)
            if len(state.tokens.get(0, [])) >= 5 + 9 * i:
                break
        rest = [t async for r in b._stub.Generate(state.point(request), timeout=60, metadata=b._metadata)
                for t in r.token_ids]
        call.cancel()
        reference = [t async for r in b._stub.Generate(request, timeout=60, metadata=b._metadata)
                     for t in r.token_ids]
        assert state.tokens[0] + rest == reference, i


async def test_standalone_frontends_with_one_link_secret_share_tenants(tmp_path: Path) -> None:
    link = link_args(tmp_path)
    frontend = [*link, "--api-key", KEY, "--engine-core-timeout", "2"]
    with running_tiers(tmp_path, EXECUTOR, core_args=[*link, "--engine-core-timeout", "2"],
                       frontend_args=frontend) as tiers:
        other, second = tiers.start_other_frontend()
        await asyncio.to_thread(wait_healthy, other, second)
        assert await prompt_hits(tiers, tiers.public) == 0
        assert await prompt_hits(tiers, other) == 48, "the other front-end's caller with the same key hits"
        for i in range(3):
            await resume_elsewhere(tiers.public, other, i)
        await asyncio.to_thread(tiers.wait_idle)


def test_the_tenant_key_is_derived_from_the_secret_and_is_not_the_secret() -> None:
    assert tenant_key(None) is None
    key = tenant_key("s3cret")
    assert key is not None and len(key) == 32 and b"s3cret" not in key
    assert tenant_key("s3cret") == key and tenant_key("other") != key
