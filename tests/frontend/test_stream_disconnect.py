"""A streamed HTTP answer whose client is gone between two chunks ends quietly, through a real aiohttp server on
127.0.0.1 and a real client connection: the transport is closing (aiohttp cancels the handler only a turn of the
event loop later), so the next chunk's write raises ConnectionResetError. It used to escape the handler, which aiohttp
logs at ERROR with a traceback, a few times per 100 clients that dropped their streams in an abort storm."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from protos.pagedserve.v1 import generation_pb2
from scheduler_service.frontend.openai.app import COMPLETIONS, Stream


async def test_a_write_after_the_client_left_ends_the_stream_without_an_error() -> None:
    outcome: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    rest_closed = asyncio.Event()

    async def rest(request: web.Request) -> AsyncGenerator[generation_pb2.GenerateResponse, None]:
        try:
            yield generation_pb2.GenerateResponse(text=" upon")
            assert request.transport is not None
            request.transport.close()  # as when the client has gone: closing now, connection_lost a turn later
            yield generation_pb2.GenerateResponse(text=" a time")  # written in the same turn: raises inside send()
            yield generation_pb2.GenerateResponse(text=" there", finish_reason=generation_pb2.FINISH_REASON_LENGTH)
        finally:
            rest_closed.set()

    async def handler(request: web.Request) -> web.StreamResponse:
        responses = rest(request)
        try:
            out = await Stream("cmpl-x", "m", COMPLETIONS, 1, None, False).send(
                request, generation_pb2.GenerateResponse(text="Once"), responses)
        except BaseException as e:
            outcome.set_result(f"raised {type(e).__name__}: {e}")
            raise
        finally:
            await responses.aclose()  # as OpenAIApi._serve's aclosing does: the call is aborted
        outcome.set_result("returned")
        return out

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
        try:
            async with session.post(server.make_url("/v1/completions"), json={}) as r:
                await r.read()
        except aiohttp.ClientError:
            pass  # the server closed the connection mid-stream: the client sees a cut answer
        assert await asyncio.wait_for(outcome, 10) == "returned"
        assert rest_closed.is_set()
