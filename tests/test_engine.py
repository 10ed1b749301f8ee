"""The engine loop in-process against a real simulated executor process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.engine import Engine
from tests.procs import free_port, start, stop, wait_healthy


@pytest.fixture
def executor(tmp_path: Path) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    proc = start("executor_service", ["--simulated", "--listen", address], tmp_path / "executor.log")
    wait_healthy(address, proc)
    yield address
    stop(proc)


async def collect(queue: asyncio.Queue[RequestDelta]) -> tuple[list[int], RequestDelta]:
    tokens: list[int] = []
    while True:
        delta = await queue.get()
        tokens += delta.new_token_ids
        if delta.finish_reason is not None:
            return tokens, delta


async def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(executor: str) -> None:
    engine = Engine(CoreConfig(), executor, max_queue_len=100)
    await engine.start()
    try:
        sched = engine._sched()
        real_update = sched.update
        calls = {"n": 0}

        def update_failing_once(out, result):  # type: ignore[no-untyped-def]
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real_update(out, result)

        sched.update = update_failing_once  # type: ignore[method-assign]
        first: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("a", [65] * 4, SamplingOptions(max_tokens=20), 0.0), first)
        tokens, last = await asyncio.wait_for(collect(first), 30)
        assert last.finish_reason is FinishReason.ERROR and "internal error" in last.error
        assert sched.blocks.device.num_used == 0 and not sched.has_unfinished()

        second: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("b", [65] * 4, SamplingOptions(max_tokens=5), 0.0), second)
        tokens, last = await asyncio.wait_for(collect(second), 30)
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) == 5
    finally:
        await engine.stop()
