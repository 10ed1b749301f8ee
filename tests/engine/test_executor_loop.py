"""The engine loop in-process against a real simulated executor process."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.engine.executor_loop import ExecutorLoop
from tests.support.engine_loop import collect
from tests.support.procs import (
    free_port,
    loopback,
    refusing_address,
    start,
    start_listening,
    stop,
    wait_healthy,
    wait_until,
)


async def test_a_failing_step_fails_its_requests_and_the_engine_carries_on(executor: str) -> None:
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100)
    await engine.start()
    try:
        sched = engine._sched()
        real_update = sched.update
        calls = {"n": 0}

        def update_failing_once(out, result):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected")
            return real_update(out, result)

        sched.update = update_failing_once  # type: ignore[method-assign]
        first: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("a", [65] * 4, SamplingOptions(max_tokens=20), 0.0), first)
        tokens, last = await asyncio.wait_for(collect(first), 30)
        assert last.finish_reason is FinishReason.ERROR and "internal error" in last.error
        assert sched.kv.device.num_used == 0 and not sched.has_unfinished()

        second: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("b", [65] * 4, SamplingOptions(max_tokens=5), 0.0), second)
        tokens, last = await asyncio.wait_for(collect(second), 30)
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) == 5
    finally:
        await engine.stop()


async def test_a_request_rejected_in_a_step_whose_executor_is_lost_still_gets_its_answer(executor: str) -> None:
    from scheduler_service.engine.executor_link import ExecutorLost

    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100)
    await engine.start()
    try:
        real_execute = engine.connection.execute
        calls = {"n": 0}

        async def lose_first(out):
            calls["n"] += 1
            if calls["n"] == 1:
                raise ExecutorLost("injected")
            return await real_execute(out)

        engine.connection.execute = lose_first  # type: ignore[method-assign]
        limit = engine._sched().limits.max_model_len
        big: asyncio.Queue[RequestDelta] = asyncio.Queue()
        small: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("big", [65] * (limit + 1), SamplingOptions(max_tokens=1), 0.0), big)
        engine.add(Request("small", [65] * 4, SamplingOptions(max_tokens=3), 0.0), small)
        _, last = await asyncio.wait_for(collect(big), 30)
        assert last.finish_reason is FinishReason.ERROR and "max_model_len" in last.error
        tokens, last = await asyncio.wait_for(collect(small), 30)
        assert last.finish_reason is FinishReason.LENGTH and len(tokens) == 3
        assert "big" not in engine.streams
    finally:
        await engine.stop()


async def test_a_step_without_answer_within_the_timeout_counts_as_a_lost_executor(tmp_path: Path) -> None:
    from scheduler_service.core.outputs import ScheduledWork, SchedulerOutput
    from scheduler_service.engine.executor_link import ExecutorConnection, ExecutorLost

    proc, ports = start_listening("executor_service", ["--simulated", "--sim-step-latency-ms", "5000"],
                                  tmp_path / "slow.log")
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        connection = ExecutorConnection(address, step_timeout=0.3)
        request = Request("a", [65] * 4, SamplingOptions(max_tokens=2), 0.0)
        out = SchedulerOutput(step_id=1, scheduled=[ScheduledWork(request, 4, [0], is_new=True)])
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(ExecutorLost, match=r"no answer to step 1 within 0\.3s"):
            await connection.execute(out)
        assert loop.time() - started < 3
        await connection.close()
    finally:
        stop(proc)


async def test_a_dying_engine_loop_fails_its_requests_and_health(executor: str) -> None:
    from scheduler_service.engine.executor_link import ExecutorLost

    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100)
    await engine.start()
    health: list[bool] = []
    engine.on_ready_change = health.append
    try:
        async def lose(out):
            raise ExecutorLost("injected")

        async def broken_recover(reason: str) -> None:
            raise RuntimeError("recovery bug")

        engine.connection.execute = lose  # type: ignore[method-assign]
        engine._recover = broken_recover  # type: ignore[method-assign]
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("a", [65] * 4, SamplingOptions(max_tokens=5), 0.0), queue)
        _, last = await asyncio.wait_for(collect(queue), 30)
        assert last.finish_reason is FinishReason.ERROR and last.error
        assert engine._task is not None
        await asyncio.wait([engine._task], timeout=10)
        assert isinstance(engine._task.exception(), RuntimeError), "the loop died"
        assert not engine.ready.is_set() and health == [False], "health says NOT_SERVING"
        late: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("b", [65] * 4, SamplingOptions(max_tokens=5), 0.0), late)
        engine._loop_ended(engine._task)  # what a death with "b" in flight does to it
        _, last = await asyncio.wait_for(collect(late), 5)
        assert last.finish_reason is FinishReason.ERROR and "engine loop stopped" in last.error
        assert not engine.streams
    finally:
        await engine.stop()


async def test_every_kind_of_stream_failure_is_a_lost_executor(executor: str) -> None:
    """A refused stream, a call already finished (asyncio.InvalidStateError), a closed stream: all
    ExecutorLost, never an internal error."""
    from scheduler_service.core.outputs import ScheduledWork, SchedulerOutput
    from scheduler_service.engine.executor_link import ExecutorConnection, ExecutorLost

    holder, intruder = ExecutorConnection(executor), ExecutorConnection(executor)
    try:
        request = Request("a", [65] * 4, SamplingOptions(max_tokens=2), 0.0)
        out = SchedulerOutput(step_id=1, scheduled=[ScheduledWork(request, 4, [0], is_new=True)])
        await holder.execute(out)
        with pytest.raises(ExecutorLost, match="FAILED_PRECONDITION: this executor already serves a scheduler"):
            await intruder.execute(out)

        class FinishedCall:
            async def write(self, message: object) -> None:
                raise asyncio.InvalidStateError("RPC already finished")

            def done(self) -> bool:
                return False

            def cancel(self) -> bool:
                return True

        intruder._call = FinishedCall()
        with pytest.raises(ExecutorLost, match="RPC already finished"):
            await intruder.execute(out)
        assert intruder._call is None, "a failed stream is dropped, so the next step opens a new one"
    finally:
        await holder.close()
        await intruder.close()


async def test_a_loading_executor_is_waited_for_with_one_info_line_and_no_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The executor's port answers nothing for longer than one Describe's deadline (a model loading; the deadline
    cut from 5 s to 1 s here), then the executor comes up: one INFO line says it is loading, none is a warning, and
    its start-up time becomes pagedserve:executor_startup_seconds. (The scheduler dials the address before the
    executor exists: a port picked before it starts, free_port.)"""
    address = f"127.0.0.1:{free_port()}"
    engine = ExecutorLoop(CoreConfig(), address, max_queue_len=100)
    describe = engine.connection.describe
    engine.connection.describe = lambda timeout=5.0: describe(timeout=1.0)  # type: ignore[method-assign]
    proc = None
    with caplog.at_level(logging.INFO, "pagedserve.engine"):
        starting = asyncio.create_task(engine.start())
        try:  # the executor starts once a Describe went unanswered past its deadline (the loading line)
            await asyncio.to_thread(wait_until, lambda: any("loading, " in r.getMessage() for r in caplog.records),
                                    timeout=60, what="the loading line")
            proc = start("executor_service", ["--simulated", "--listen", address], tmp_path / "executor.log")
            await asyncio.wait_for(starting, 60)
            assert engine.metrics is not None
            startup = engine.metrics.registry.get_sample_value(
                "pagedserve:executor_startup_seconds", {"model_name": engine.metrics.model_name, "executor": address})
        finally:
            await engine.stop()
            if proc is not None:
                stop(proc)
    records = [r for r in caplog.records if r.name == "pagedserve.engine"]
    assert not [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    loading = [r.getMessage() for r in records if "loading" in r.getMessage()]
    assert len(loading) == 2 and "loading, " in loading[0] and "answered after" in loading[1], loading
    assert engine.describe is not None and engine.describe.startup_seconds > 0
    assert startup == engine.describe.startup_seconds


async def test_an_executor_silent_past_the_load_timeout_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with refusing_address() as nowhere:
        await warns_about_silent_executor(nowhere, caplog)


async def warns_about_silent_executor(address: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = ExecutorLoop(CoreConfig(), address, max_queue_len=100)
    engine.load_warn_s = 0.0
    describe = engine.connection.describe
    engine.connection.describe = lambda timeout=5.0: describe(timeout=0.2)  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, "pagedserve.engine"):
        starting = asyncio.create_task(engine.start())
        deadline = asyncio.get_running_loop().time() + 60  # the warning itself ends the wait, not a guess at its time
        while not any("not answering Describe for" in r.getMessage() for r in caplog.records
                      if r.levelno == logging.WARNING):
            assert asyncio.get_running_loop().time() < deadline, "no warning about the silent executor"
            await asyncio.sleep(0.02)
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await engine.stop()


async def test_a_request_ended_and_added_again_under_its_id_gets_no_token_of_the_old_one(executor: str) -> None:
    """Async scheduling routes a step's deltas after sending the next step; a request aborted and re-added with
    the same id in between (a resumed request superseding its lost copy, #28) must not receive the old one's."""
    engine = ExecutorLoop(CoreConfig(async_scheduling=True), executor, max_queue_len=100)
    await engine.start()
    try:
        sampling = SamplingOptions(max_tokens=40, seed=5, ignore_eos=True)
        reference: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("ref", [65] * 6, sampling, 0.0), reference)
        expected, _ = await asyncio.wait_for(collect(reference), 30)
        first: asyncio.Queue[RequestDelta] = asyncio.Queue()
        second: asyncio.Queue[RequestDelta] = asyncio.Queue()
        sched = engine._sched()
        real_update, calls, delivered = sched.update, [0], []

        def swap() -> None:  # runs at the loop's next await: the step's deltas are read, not yet routed
            while not first.empty():
                delivered.extend(first.get_nowait().new_token_ids)
            engine.abort("r")
            engine.add(Request("r", [65] * 6, sampling, 0.0, output_token_ids=list(delivered)), second)

        def update(out, result):
            calls[0] += 1
            if calls[0] == 8:
                asyncio.get_running_loop().call_soon(swap)
            return real_update(out, result)

        sched.update = update  # type: ignore[method-assign]
        engine.add(Request("r", [65] * 6, sampling, 0.0), first)
        rest, last = await asyncio.wait_for(collect(second), 30)
        assert delivered and delivered + rest == expected and last.finish_reason is FinishReason.LENGTH
    finally:
        await engine.stop()
