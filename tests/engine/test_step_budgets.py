"""The scheduler sizes its per-step budgets from the limits the executor advertises in Describe (#27): the
smaller of its own flags and the executor's, so that no step it sends is refused for its size."""

from __future__ import annotations

import asyncio

import pytest

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta, SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.engine.executor_loop import ExecutorLoop, step_budgets


def describe(tokens: int, seqs: int, lookahead: int) -> executor_pb2.DescribeResponse:
    return executor_pb2.DescribeResponse(capabilities=executor_pb2.Capabilities(
        max_num_batched_tokens=tokens, max_num_seqs=seqs, max_num_lookahead_slots=lookahead))


def test_budgets_are_the_smaller_of_the_flags_and_the_executors_limits() -> None:
    flags = CoreConfig(max_num_batched_tokens=8192, max_num_seqs=1024, num_lookahead_slots=100)
    sized = step_budgets(flags, describe(2048, 256, 64))
    assert (sized.max_num_batched_tokens, sized.max_num_seqs, sized.num_lookahead_slots) == (2048, 256, 64)
    assert (flags.max_num_batched_tokens, flags.max_num_seqs) == (8192, 1024), "the flags' config is not changed"
    small = CoreConfig(max_num_batched_tokens=512, max_num_seqs=8)
    assert step_budgets(small, describe(2048, 256, 64)) is small
    assert step_budgets(flags, describe(0, 0, 0)) is flags, "0: the executor advertises no limit"


@pytest.fixture(scope="module")
def executor_args() -> list[str]:
    return ["--max-num-batched-tokens", "64", "--max-num-seqs", "4"]


async def test_flags_above_the_executors_limits_schedule_steps_it_accepts(executor: str) -> None:
    flags = CoreConfig(max_num_batched_tokens=8192, max_num_seqs=1024, num_lookahead_slots=100)
    engine = ExecutorLoop(flags, executor, max_queue_len=100)
    await engine.start()
    try:
        sched = engine.scheduler
        assert sched is not None
        assert (sched.config.max_num_batched_tokens, sched.config.max_num_seqs, sched.config.num_lookahead_slots) \
            == (64, 4, 64)
        steps: list[SchedulerOutput] = []
        schedule = sched.schedule

        def recorded() -> SchedulerOutput:
            out = schedule()
            steps.append(out)
            return out

        sched.schedule = recorded  # type: ignore[method-assign]
        queues: list[asyncio.Queue[RequestDelta]] = []
        for i in range(12):
            queues.append(asyncio.Queue())
            engine.add(Request(f"r{i}", [65 + i] * 100, SamplingOptions(max_tokens=8, ignore_eos=True), 0.0),
                       queues[-1])
        finals = await asyncio.wait_for(asyncio.gather(*(last_delta(q) for q in queues)), 60)
        assert all(d.finish_reason is FinishReason.LENGTH and not d.error for d in finals), finals
        assert steps and max(len(s.scheduled) for s in steps) <= 4
        assert max(s.total_num_scheduled_tokens for s in steps) <= 64
    finally:
        await engine.stop()


async def last_delta(queue: asyncio.Queue[RequestDelta]) -> RequestDelta:
    while True:
        delta = await queue.get()
        if delta.finish_reason is not None:
            return delta
