"""Front-end restarts under streaming load (#28): a SIGKILLed front-end's client-library streams resume on another
front-end from the tokens the client has (no token twice, none missing, same text); a SIGTERMed front-end drains
its HTTP SSE streams to the end."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp

from client.lib import PagedServeClient, ResumeState, build_request
from client.local import stop, wait_healthy, wait_until
from protos.pagedserve.v1 import generation_pb2
from tests.support.streams import EXECUTOR, TokenCount, check_complete, run_all, specs
from tests.support.tiers import running_tiers

CORE = ["--engine-core-timeout", "2"]  # a dead front-end's sequences without a token are freed within 2 s


async def test_frontend_sigkill_mid_stream_client_library_resumes_identically(tmp_path: Path) -> None:
    calls = specs(16)
    total = sum(s.n for s in calls) * 48
    with running_tiers(tmp_path, EXECUTOR, core_args=CORE) as tiers:
        reference = await run_all(tiers.public, calls)
        check_complete(reference, calls)
        tiers.wait_idle()
        count = TokenCount(total)
        first = tiers.frontends[0]
        disturbed = asyncio.create_task(run_all(tiers.public, calls, count, resume_attempts=8))
        await asyncio.wait_for(count.quarter.wait(), 60)
        second = tiers.start_frontend()  # the survivor on the same port (as replicas behind one Service)
        await asyncio.to_thread(wait_healthy, tiers.public, second)
        stop(first, signal.SIGKILL)
        assert count.seen < total, "the kill came while tokens were still to come"
        outcome = await asyncio.wait_for(disturbed, 120)
        check_complete(outcome, calls)
        assert outcome == reference, "tokens and text of the undisturbed run, none twice, none missing"
        await asyncio.to_thread(tiers.wait_idle)


async def test_a_call_resumed_on_another_frontend_supersedes_the_one_still_streaming(tmp_path: Path) -> None:
    """The client's resume reaches the core before it noticed the first front-end gone: the continuation takes the
    request over (same id) and yields exactly the tokens the first call had still to send; the first call, its
    front-end alive, ends at once with ABORT."""
    with running_tiers(tmp_path, EXECUTOR, core_args=CORE) as tiers:
        other, frontend = tiers.start_other_frontend()
        await asyncio.to_thread(wait_healthy, other, frontend)
        params = {"prompt_token_ids": [7, 8, 9], "max_tokens": 60, "ignore_eos": True, "temperature": 1.0}
        for i in range(2):  # one unseeded and one seeded call (were four, alternating), cut early and late
            request = build_request(request_id=f"r{i}", seed=i if i % 2 else None, **params)  # type: ignore[arg-type]
            async with PagedServeClient(tiers.public) as a, PagedServeClient(other) as b:
                state = ResumeState()
                first = a._stub.Generate(request, timeout=60)
                async for r in first:
                    state.take(r)
                    if len(state.tokens.get(0, [])) >= 5 + 27 * i:
                        break
                rest = [t async for r in b._stub.Generate(state.point(request), timeout=60) for t in r.token_ids]
                last = await asyncio.wait_for(last_response(first), 30)  # it ends: it used to wait for its deadline
                assert last.finish_reason == generation_pb2.FINISH_REASON_ABORT and "superseded" in last.error
                reference = [t async for r in b._stub.Generate(request, timeout=60) for t in r.token_ids]
                assert state.tokens[0] + rest == reference, i
        await asyncio.to_thread(tiers.wait_idle)


async def last_response(call: Any) -> generation_pb2.GenerateResponse:
    """The rest of a call iterated before (grpc.aio keeps its one iterator), to its end: the last response."""
    last = generation_pb2.GenerateResponse()
    async for response in call:
        last = response
    return last


async def sse_completion(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str | None]:
    """One streamed /v1/completions call: (chunks with text, its finish reason)."""
    body = {"prompt": [100 + i, 101, 102], "max_tokens": 40, "stream": True, "ignore_eos": True, "seed": i}
    chunks, reason = 0, None
    async with session.post(url, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            choice = json.loads(text[6:])["choices"][0]
            chunks += 1
            reason = choice.get("finish_reason") or reason
    return chunks, reason


async def test_frontend_sigterm_drains_its_http_sse_streams(tmp_path: Path) -> None:
    with running_tiers(tmp_path, EXECUTOR, core_args=CORE) as tiers:
        url = f"http://{tiers.http}/v1/completions"
        async with aiohttp.ClientSession() as session:
            calls = [asyncio.create_task(sse_completion(session, url, i)) for i in range(12)]
            await asyncio.to_thread(wait_until, lambda: tiers.metrics().get("vllm:num_requests_running", 0) > 0,
                                    30.0, "streams running")
            tiers.frontends[0].send_signal(signal.SIGTERM)
            results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        assert all(reason == "length" and chunks > 1 for chunks, reason in results), results
        assert tiers.frontends[0].wait(30) == 0
        await asyncio.to_thread(tiers.wait_idle)
