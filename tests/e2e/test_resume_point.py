"""GenerateRequest.resume (#28) against a real server: a call resumed after any response continues with exactly
the remaining tokens and text (held-back text of an open stop-string match included); bad resume points are
INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from client.lib import PagedServeClient, ResumeState, build_request
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import Stack, running_stack

PARAMS: dict[str, Any] = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "temperature": 1.0,
                          "seed": 3, "n": 2, "stop": ["\x00\x01never"], "request_id": "resume-me"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One api server process over the engine core: the resume point crosses the core link."""
    with running_stack(tmp_path_factory.mktemp("resume"), ["--simulated"], ["--api-server-count", "1"]) as s:
        yield s


async def responses(client: PagedServeClient, request: generation_pb2.GenerateRequest
                    ) -> list[generation_pb2.GenerateResponse]:
    return [r async for r in client._stub.Generate(request, timeout=60)]


async def test_a_call_resumed_after_any_response_continues_exactly(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        request = build_request(**PARAMS)
        full = await responses(client, request)
        whole = {i: ("".join(r.text for r in full if r.index == i),
                     [t for r in full if r.index == i for t in r.token_ids]) for i in (0, 1)}
        for cut in range(1, len(full) - 1, 3):
            state = ResumeState()
            for r in full[:cut]:
                state.take(r)
            rest = await responses(client, state.point(request))
            for i in (0, 1):
                text = "".join(r.text for r in full[:cut] + rest if r.index == i)
                ids = [t for r in full[:cut] + rest if r.index == i for t in r.token_ids]
                assert (text, ids) == whole[i], (cut, i)
                last = [r for r in rest if r.index == i and r.finish_reason]
                assert len(last) == (0 if i in state.finished else 1), (cut, i)
                if last:
                    assert last[0].usage.completion_tokens == 24 and last[0].usage.prompt_tokens > 0


@pytest.mark.parametrize(("resume", "field"), [
    ([{"index": 2, "token_ids": [5]}], "resume[0].index"),
    ([{"index": 0, "token_ids": [5] * 24}], "resume[0].token_ids"),
    ([{"index": 0, "token_ids": [10**6]}], "resume[0].token_ids"),
    ([{"index": 0, "token_ids": [5]}, {"index": 0}], "resume[1].index"),
    ([{"index": 0, "finished": True}, {"index": 1, "finished": True}], "resume"),
])
async def test_a_bad_resume_point_is_invalid_argument_naming_the_field(
        stack: Stack, resume: list[dict[str, Any]], field: str) -> None:
    async with PagedServeClient(stack.address) as client:
        request = build_request(**PARAMS)
        for r in resume:
            request.resume.add(**r)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await responses(client, request)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith(field + ":"), e.value.details()
        request.request_id = ""
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await responses(client, request)
        assert (e.value.details() or "").startswith("request_id:")


def regex_request(resumed: list[int] | None = None) -> generation_pb2.GenerateRequest:
    request = build_request(prompt="hi", max_tokens=6, seed=5, request_id="resume-regex")
    request.sampling.structured_outputs.regex = "[ab]+"
    if resumed is not None:
        request.resume.add(index=0, token_ids=resumed)
    return request


async def test_resumed_tokens_the_grammar_forbids_are_invalid_argument_and_allowed_ones_continue(stack: Stack) -> None:
    """The resume point's tokens are the client's: ones its own structured_outputs forbid are INVALID_ARGUMENT
    naming resume (they failed at the first step as the executor's fault, "the executor sampled token ...")."""
    async with PagedServeClient(stack.address) as client:
        probe = await responses(client, build_request(prompt="zzzz", max_tokens=1, prompt_logprobs=0))
        forbidden = list(probe[0].prompt_token_ids)[-1:]
        allowed = [t for r in await responses(client, regex_request()) for t in r.token_ids]
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await responses(client, regex_request(forbidden))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (caught.value.details() or "").startswith("resume.token_ids: token "), caught.value.details()
        rest = await responses(client, regex_request(allowed[:2]))
        assert rest[-1].finish_reason != generation_pb2.FINISH_REASON_ERROR, rest[-1].error
        assert allowed[:2] + [t for r in rest for t in r.token_ids] == allowed
