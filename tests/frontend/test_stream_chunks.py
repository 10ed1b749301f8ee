"""The SSE chunks of a streamed answer, through a real aiohttp server on 127.0.0.1 and a real client: each event is
the compact JSON of the whole chunk (id, object, created, model, choices, and usage where asked) whatever the model's
name holds. Since #29 (seventh session) the chunk's fixed part is rendered once per stream; the bytes must stay
those of the whole chunk's dict encoded per event."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from protos.pagedserve.v1 import generation_pb2
from scheduler_service.frontend.openai.app import CHAT, COMPLETIONS, Endpoint, Stream

LENGTH = generation_pb2.FINISH_REASON_LENGTH
MODEL = 'odd "choices":null model \u00e9\u4e2d'  # the fixed part must not be cut inside the model's name


async def sse_events(endpoint: Endpoint, include_usage: bool) -> tuple[Stream, list[bytes]]:
    stream = Stream("cmpl-x", MODEL, endpoint, 1, None, include_usage)

    async def rest() -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        yield generation_pb2.GenerateResponse(text=" upon", token_ids=[2])
        yield generation_pb2.GenerateResponse(text=" a time", token_ids=[3, 4], finish_reason=LENGTH)

    async def handler(request: web.Request) -> web.StreamResponse:
        return await stream.send(request, generation_pb2.GenerateResponse(text="Once", token_ids=[1]), rest())

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session, \
            session.post(server.make_url("/v1/completions"), json={}) as r:
        body = await r.read()
    return stream, [e for e in body.split(b"\n\n") if e]


def compact(data: object) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize("include_usage", [False, True])
async def test_completion_chunks_are_the_whole_chunk_encoded(include_usage: bool) -> None:
    stream, events = await sse_events(COMPLETIONS, include_usage)
    head = {"id": "cmpl-x", "object": "text_completion", "created": stream.created, "model": MODEL}
    usage = {"usage": None} if include_usage else {}
    texts = [("Once", None), (" upon", None), (" a time", "length")]
    expected = [compact({**head, "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": r,
                                              **({"stop_reason": None} if r else {})}], **usage})
                for t, r in texts]
    if include_usage:
        expected.append(compact({**head, "choices": [], "usage": stream.usage.body()}))
    assert events == [*expected, b"data: [DONE]"]


async def test_chat_chunks_are_the_whole_chunk_encoded() -> None:
    stream, events = await sse_events(CHAT, include_usage=False)
    head = {"id": "cmpl-x", "object": "chat.completion.chunk", "created": stream.created, "model": MODEL}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    deltas = [({"content": "Once"}, None), ({"content": " upon"}, None), ({"content": " a time"}, "length")]
    expected = [compact({**head, "choices": [role]})]
    expected += [compact({**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": r,
                                               **({"stop_reason": None} if r else {})}]}) for d, r in deltas]
    assert events == [*expected, b"data: [DONE]"]
