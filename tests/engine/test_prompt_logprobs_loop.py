"""Prompt logprobs in the engine loop (#30), in-process against a real simulated executor: delivered once and whole
with chunked prefill under async scheduling, and refused with an error naming the field when the executor does not
advertise them."""

from __future__ import annotations

import asyncio

import pytest

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.simulated import SimulatedBackend
from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.engine.executor_loop import ExecutorLoop

PROMPT = [40 + (i * 7) % 50 for i in range(37)]


@pytest.fixture(scope="module")
def executor_args() -> list[str]:
    return ["--sim-step-latency-ms", "1"]


async def deltas_of(engine: ExecutorLoop, request: Request) -> list[RequestDelta]:
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    engine.add(request, queue)
    out: list[RequestDelta] = []
    while not out or out[-1].finish_reason is None:
        out.append(await asyncio.wait_for(queue.get(), 30))
    return out


def asking(rid: str) -> Request:
    return Request(rid, list(PROMPT), SamplingOptions(max_tokens=5, ignore_eos=True, prompt_logprobs=1), 0.0)


async def test_prompt_logprobs_come_once_whole_through_chunks_under_async_scheduling(executor: str) -> None:
    engine = ExecutorLoop(CoreConfig(async_scheduling=True, max_num_batched_tokens=8), executor, max_queue_len=10)
    await engine.start()
    try:
        deltas = await deltas_of(engine, asking("a"))
        carrying = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
        assert len(carrying) == 1 and deltas[-1].finish_reason is FinishReason.LENGTH
        item = BatchItem("a", PROMPT, len(PROMPT), 0, len(PROMPT), [], False, SamplingConfig(prompt_logprobs=1))
        expected = [SimulatedBackend.prompt_logprob(item, p) for p in range(1, len(PROMPT))]
        assert [lp.token_id for lp in carrying[0]] == PROMPT[1:]
        assert all(abs(lp.logprob - (e.logprob or 0.0)) < 1e-6 for lp, e in zip(carrying[0], expected, strict=True))
        assert sum(len(d.new_token_ids) for d in deltas) == 5
    finally:
        await engine.stop()


async def test_an_executor_without_prompt_logprobs_gets_no_such_request(executor: str) -> None:
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=10)
    await engine.start()
    try:
        assert engine.describe is not None and engine.describe.capabilities.prompt_logprobs
        engine.describe.capabilities.prompt_logprobs = False
        (end,) = await deltas_of(engine, asking("b"))
        assert end.finish_reason is FinishReason.ERROR and "sampling.prompt_logprobs" in end.error
        plain = await deltas_of(engine, Request("c", list(PROMPT), SamplingOptions(max_tokens=2), 0.0))
        assert plain[-1].finish_reason is not FinishReason.ERROR
    finally:
        await engine.stop()
