"""Request ids belong to their API key: one key cannot learn that another key's request id is in use (ALREADY_EXISTS
once told it), nor end or replace another key's open call by sending a resume for its id. Checked where the keys
share one prefix cache (--enable-cross-tenant-prefix-caching), since that is where their cache scopes agree, with
two api servers (the calls may land on the same one or on different ones) and the simulated executor at 10 ms a
step, so a 400-token call stays open for seconds while the other key's calls run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from client.lib import ResumeState, build_request
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from tests.support.procs import Stack, running_stack

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ALPHA, BETA = "alpha-key", "beta-key"
LONG = 400


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    scheduler = ["--api-key", ALPHA, "--api-key", BETA, "--api-server-count", "2",
                 "--enable-cross-tenant-prefix-caching"]
    with running_stack(tmp_path_factory.mktemp("ids"), ["--simulated", "--sim-step-latency-ms", "10"],
                       scheduler) as s:
        yield s


def call(channel: grpc.aio.Channel, key: str, request: generation_pb2.GenerateRequest
         ) -> grpc.aio.UnaryStreamCall:
    return generation_pb2_grpc.GenerationStub(channel).Generate(
        request, metadata=[("authorization", f"Bearer {key}")], timeout=60)


async def tokens_of(responses: AsyncIterator[generation_pb2.GenerateResponse], state: ResumeState) -> ResumeState:
    async for r in responses:
        assert not r.error, r.error
        state.take(r)
    return state


def long_request(request_id: str) -> generation_pb2.GenerateRequest:
    return build_request(prompt_token_ids=[5, 6, 7], request_id=request_id, max_tokens=LONG, ignore_eos=True)


async def test_another_key_may_use_an_open_calls_id_and_the_same_key_may_not(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.address) as a, grpc.aio.insecure_channel(stack.address) as b:
        alpha = call(a, ALPHA, long_request("shared-id")).__aiter__()
        state = ResumeState()
        state.take(await anext(alpha))  # alpha's call is open in the engine
        beta = await tokens_of(call(b, BETA, build_request(prompt_token_ids=[9], request_id="shared-id",
                                                           max_tokens=5, ignore_eos=True)), ResumeState())
        assert len(beta.tokens[0]) == 5 and beta.finished == {0}
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await tokens_of(call(a, ALPHA, long_request("shared-id")), ResumeState())
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "'shared-id'" in (refused.value.details() or "")
        await tokens_of(alpha, state)
        assert len(state.tokens[0]) == LONG and state.finished == {0}


async def test_a_resume_sent_with_another_key_leaves_the_open_call_alone(stack: Stack) -> None:
    request = long_request("victim")
    async with grpc.aio.insecure_channel(stack.address) as a, grpc.aio.insecure_channel(stack.address) as b:
        alpha = call(a, ALPHA, request).__aiter__()
        state = ResumeState()
        state.take(await anext(alpha))
        forged = ResumeState()
        forged.take(generation_pb2.GenerateResponse(index=0, token_ids=state.tokens[0]))
        intruder = await tokens_of(call(b, BETA, forged.point(request)), forged)
        assert len(intruder.tokens[0]) == LONG  # beta's own continuation, run as a call of beta's
        await tokens_of(alpha, state)
        assert len(state.tokens[0]) == LONG and state.finished == {0}
