"""The benchmark's OpenAI client (client/bench/openai_backend.py) sends a request once more when the server drops
its connection before answering (llama-server closes pooled keep-alive connections after a few requests: one
request of 128 was lost in some rounds of benchmarks/vs_llamacpp.py, #29), and never a request that was answered."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from client.bench.datasets import BenchRequest
from client.bench.openai_backend import OpenAIBenchClient
from client.bench.runner import RunConfig
from client.bench.stats import RequestTrace

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CFG = RunConfig(timeout=30)
REQUEST = BenchRequest(prompt_len=1, max_tokens=2, prompt="a")


def event(data: dict[str, object]) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


async def answer(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    await out.write(event({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}))
    await out.write(event({"choices": [], "usage": {"completion_tokens": 2}}))
    await out.write(b"data: [DONE]\n\n")
    return out


async def send(handler: Handler) -> tuple[RequestTrace, list[str]]:
    """One request through the bench client to a server on 127.0.0.1 whose /v1/completions is `handler`; the
    trace and what the server saw, call by call."""
    calls: list[str] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        calls.append((await request.json())["prompt"])
        return await handler(request)

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with OpenAIBenchClient(f"http://127.0.0.1:{port}") as client:
            trace = await client.send_one(REQUEST, CFG, time.perf_counter())
    finally:
        await runner.cleanup()
    return trace, calls


def drop(request: web.Request) -> web.StreamResponse:
    """Close the connection unanswered, as a server closing a pooled keep-alive connection does."""
    if request.transport is not None:
        request.transport.close()
    raise web.HTTPInternalServerError()  # (nothing reaches the client: its connection is gone)


async def test_a_request_dropped_before_its_answer_is_sent_once_more() -> None:
    dropped: list[bool] = []

    async def drop_the_first(request: web.Request) -> web.StreamResponse:
        if dropped:
            return await answer(request)
        dropped.append(True)
        return drop(request)

    trace, calls = await send(drop_the_first)
    assert calls == ["a", "a"]
    assert trace.success and trace.text == "hi" and trace.output_len == 2 and trace.error == ""


async def test_a_request_dropped_twice_fails_with_the_reason() -> None:
    async def always_drop(request: web.Request) -> web.StreamResponse:
        return drop(request)

    trace, calls = await send(always_drop)
    assert calls == ["a", "a"]
    assert not trace.success and "ServerDisconnectedError" in trace.error


async def test_a_stream_cut_after_its_answer_began_is_not_sent_again() -> None:
    async def cut(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(event({"choices": [{"index": 0, "text": "h", "finish_reason": None}]}))
        if request.transport is not None:
            request.transport.close()
        return out

    trace, calls = await send(cut)
    assert calls == ["a"]
    assert not trace.success and trace.error and trace.text == "h"
