"""A constraint whose grammar takes too long to compile is refused as the client's fault, through the real
processes: HTTP 400 naming the field, gRPC INVALID_ARGUMENT, and the server's next constrained request is served.
The engine core compiles in a process of its own under --structured-outputs-compile-timeout (0.5 s here)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import grpc
import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import common_pb2
from tests.support.procs import Stack, run, running_http_stack

MODEL = "default-model-v2"
EXECUTOR = ["--device", "cpu", "--num-gpu-blocks", "64", "--num-cpu-blocks", "0"]
COSTLY = {"type": "string", "pattern": "(.{1,8}){1,64}"}
"""Within the api server's pattern bounds (512 repeats, nested 2 deep), and ~5 s to compile on the default
model's 2k vocabulary when the box is quiet: ten times the deadline here, more when it is loaded."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    args = ["--structured-outputs-compile-timeout", "0.5"]
    with running_http_stack(tmp_path_factory.mktemp("deadline"), EXECUTOR, args) as s:
        yield s, f"{s.http_url}/v1"


async def test_http_a_grammar_past_the_compile_deadline_is_400_naming_the_field(stack: tuple[Stack, str]) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": COSTLY}}}
    async with aiohttp.ClientSession() as session, session.post(stack[1] + "/completions", json=body) as r:
        answer = await r.json()
    assert r.status == 400, answer  # (a 500 "generation failed" before, once the compile ended minutes later)
    error = answer["error"]
    assert error["message"] == ("sampling.structured_outputs.json: grammar too complex: compile exceeded 0.5 s "
                                "(--structured-outputs-compile-timeout)"), error
    assert error["type"] == "invalid_request_error" and error["param"] in ("response_format", "structured_outputs")


async def test_grpc_a_grammar_past_the_compile_deadline_is_invalid_argument_and_the_next_is_served(
        stack: tuple[Stack, str]) -> None:
    async with PagedServeClient(stack[0].address) as c:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await run(c, prompt="x", max_tokens=4, structured_outputs=common_pb2.StructuredOutputs(
                json=json.dumps({"type": "object", "properties": {"k": COSTLY}, "required": ["k"]})))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.structured_outputs.json: grammar too complex" in (caught.value.details() or "")
        _, text, _, error = await run(c, prompt="x", max_tokens=8, temperature=0.0,
                                      structured_outputs=common_pb2.StructuredOutputs(choice=["alpha", "beta"]))
        assert text in ("alpha", "beta"), (text, error)
