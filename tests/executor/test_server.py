"""The executor shell in-process (simulated backend): a bad step never kills the stream or another request."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_service.backend import BackendLost, BatchItem, SampleOutput, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.server import ExecutorServicer, serve, start_serving
from executor_service.simulated import SimulatedBackend
from executor_service.validator import StepLimits
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc


def servicer(max_model_len: int = 64) -> ExecutorServicer:
    config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4,
                            max_model_len=max_model_len)
    return ExecutorServicer(SimulatedBackend(config))


async def assert_ends_unavailable(call: grpc.aio.StreamStreamCall, detail: str) -> None:
    """The Execute stream ends UNAVAILABLE (detail in its message) without answering the step just sent."""
    with pytest.raises(grpc.aio.AioRpcError) as ended:
        answer = await call.read()
        pytest.fail(f"the step was answered: {answer}")
    assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
    assert detail in (ended.value.details() or "")


def new(rid: str, blocks: list[int], n: int = 4) -> executor_pb2.NewRequest:
    return executor_pb2.NewRequest(request_id=rid, token_ids=[65] * n, num_prompt_tokens=n, num_scheduled_tokens=n,
                                   block_ids=blocks)


async def test_a_request_id_twice_in_one_step_is_refused_and_changes_nothing() -> None:
    s = servicer()
    step = executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0]), new("a", [1]), new("c", [2])])
    result = await s.run_step(step)
    assert "more than once" in result.error and not s.table.states
    ok = await s.run_step(executor_pb2.StepRequest(step_id=2, new_requests=[new("c", [0])]))
    assert not ok.error and list(ok.sampled.request_ids) == ["c"]


async def test_multi_step_stops_at_max_model_len_without_failing_the_step() -> None:
    s = servicer(max_model_len=8)
    prefill = executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0, 1], n=5), new("b", [2, 3])])
    first = await s.run_step(prefill)
    assert not first.error
    running = executor_pb2.RunningRequests(request_ids=["a", "b"], num_scheduled_tokens=[1, 1], num_new_blocks=[0, 0])
    result = await s.run_step(executor_pb2.StepRequest(step_id=2, running=running, num_steps=4))
    assert not result.error and not result.errors
    counts = dict(zip(result.sampled.request_ids, result.sampled.num_tokens, strict=True))
    assert counts == {"a": 2, "b": 3}
    assert len(s.table.states["a"].token_ids) == 8


async def test_a_bad_token_fails_only_its_request() -> None:
    s = servicer()
    bad = executor_pb2.NewRequest(request_id="b", token_ids=[10**6], num_prompt_tokens=1, num_scheduled_tokens=1,
                                  block_ids=[1])
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0]), bad]))
    assert not result.error
    assert [e.request_id for e in result.errors] == ["b"] and list(result.sampled.request_ids) == ["a"]


async def test_a_backend_exception_fails_the_step_and_the_stream_carries_on() -> None:
    s = servicer()
    real_execute = s.backend.execute

    def explode(items):
        raise RuntimeError("device on fire")

    s.backend.execute = explode  # type: ignore[method-assign]
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
    assert result.step_id == 1 and result.error == "device on fire"
    assert not result.sampled.request_ids and not s.table.states, "the failed step's requests are dropped"
    s.backend.execute = real_execute  # type: ignore[method-assign]
    ok = await s.run_step(executor_pb2.StepRequest(step_id=2, new_requests=[new("a", [0])]))
    assert not ok.error and list(ok.sampled.request_ids) == ["a"]


async def test_a_lost_backend_ends_the_stream_unanswered_over_grpc() -> None:
    """A tensor-parallel peer gone mid-step (BackendLost) must not be answered as a failed step (its
    requests would end in error): the stream ends UNAVAILABLE, which the scheduler treats as a lost
    executor and recomputes."""
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))

    async def lose(items: list[BatchItem]) -> list[SampleOutput | None]:
        raise BackendLost("forward pass: connection closed by peer")

    backend.execute_async = lose  # type: ignore[method-assign]
    server, port = await serve(backend, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Execute()
            await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
            await assert_ends_unavailable(call, "connection closed by peer")
    finally:
        await server.stop(None)


async def test_num_steps_above_the_advertised_max_is_refused() -> None:
    s = servicer()
    first = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0, 1])]))
    assert not first.error
    running = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0])
    refused = await s.run_step(executor_pb2.StepRequest(step_id=2, running=running, num_steps=10**9))
    assert refused.error == "num_steps 1000000000 exceeds max_num_steps 64 (Describe.capabilities)"
    assert not refused.sampled.request_ids
    at_max = await s.run_step(executor_pb2.StepRequest(step_id=3, running=running, num_steps=2))
    assert not at_max.error and list(at_max.sampled.num_tokens) == [2]


async def test_the_simulated_executor_answers_logprobs() -> None:
    s = servicer()
    asked = new("a", [0])
    asked.sampling.logprobs = 3
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[asked, new("b", [1])]))
    assert [lp.request_id for lp in result.logprobs] == ["a"]
    (token,) = result.logprobs[0].tokens
    assert token.token_id == result.sampled.token_ids[0] and token.logprob == 0.0
    assert [(t.token_id, t.logprob) for t in token.top] == [(token.token_id, 0.0)]


async def test_a_stream_ends_unavailable_at_its_next_step_once_the_executor_is_stopping() -> None:
    """SIGTERM sets `stopping`: the scheduler hears of it at once (and recomputes), rather than having
    steps served through the shutdown's grace period."""
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))
    stopping = asyncio.Event()
    server, port = await serve(backend, "127.0.0.1:0", stopping=stopping)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Execute()
            await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
            first = await call.read()
            assert not first.error and list(first.sampled.request_ids) == ["a"]
            stopping.set()
            running = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0])
            await call.write(executor_pb2.StepRequest(step_id=2, running=running))
            await assert_ends_unavailable(call, "shutting down")
    finally:
        await server.stop(None)


async def test_the_step_log_has_one_line_per_step_with_its_work_and_timings() -> None:
    import io
    import json

    config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
    log = io.StringIO()
    s = ExecutorServicer(SimulatedBackend(config), step_log=log)
    assert not (await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0, 1], n=5),
                                                                                    new("b", [2, 3])]))).error
    running = executor_pb2.RunningRequests(request_ids=["a", "b"], num_scheduled_tokens=[1, 1], num_new_blocks=[0, 0])
    assert not (await s.run_step(executor_pb2.StepRequest(step_id=2, running=running))).error
    # 8 passes asked; the tables (2 blocks of 4) hold 2 more tokens of "a" and 3 more of "b": 3 passes run
    assert not (await s.run_step(executor_pb2.StepRequest(step_id=3, running=running, num_steps=8))).error
    prefill, decode, multi = (json.loads(line) for line in log.getvalue().splitlines())
    assert multi["passes"] == 3 and multi["seqs"] == 2
    assert {k: prefill[k] for k in ("seqs", "tokens", "sampled", "attended", "context", "passes")} == {
        "seqs": 2, "tokens": 9, "sampled": 2, "attended": 15 + 10, "context": 9, "passes": 1}
    assert {k: decode[k] for k in ("seqs", "tokens", "sampled", "attended", "context")} == {
        "seqs": 2, "tokens": 2, "sampled": 2, "attended": 6 + 5, "context": 11}
    assert 0 < decode["forward_ns"] <= decode["total_ns"]
    # each step's start on one clock: the gap after a step (its start + total_ns to the next start) is idle time
    assert prefill["start_ns"] + prefill["total_ns"] <= decode["start_ns"]
    assert decode["start_ns"] + decode["total_ns"] <= multi["start_ns"]


async def test_the_step_log_over_grpc_splits_the_gap_between_steps_into_answering_and_waiting() -> None:
    """Over a real Execute stream: a step's resumed_ns (the stream got control back after the step before it was
    answered) lies between that step's end and its own start; the first step of a stream has none (0)."""
    import io
    import json

    log = io.StringIO()
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))
    server, port = await serve(backend, "127.0.0.1:0", step_log=log)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Execute()
            await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
            assert not (await call.read()).error
            running = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0])
            await call.write(executor_pb2.StepRequest(step_id=2, running=running))
            assert not (await call.read()).error
            await call.done_writing()
    finally:
        await server.stop(None)
    first, second = (json.loads(line) for line in log.getvalue().splitlines())
    assert first["resumed_ns"] == 0
    assert first["start_ns"] + first["total_ns"] <= second["resumed_ns"] <= second["start_ns"]


async def test_a_step_log_that_cannot_be_written_turns_off_and_the_step_is_served() -> None:
    class FullDisk:
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

    config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
    s = ExecutorServicer(SimulatedBackend(config), step_log=FullDisk())  # type: ignore[arg-type]
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
    assert not result.error and list(result.sampled.request_ids) == ["a"] and s.step_log is None


def test_sampled_columns_are_read_by_their_counts_even_when_they_have_as_many_tokens_as_requests() -> None:
    from scheduler_service.core.outputs import SchedulerOutput
    from scheduler_service.engine.executor_link import MalformedResult, result_from_proto

    def result(ids: list[str], counts: list[int], tokens: list[int]) -> executor_pb2.StepResult:
        return executor_pb2.StepResult(step_id=1, sampled=executor_pb2.SampledTokens(
            request_ids=ids, num_tokens=counts, token_ids=tokens))

    out = SchedulerOutput(step_id=1)
    read = result_from_proto(result(["a", "b"], [0, 2], [7, 8]), out)  # as many tokens as requests, not one each
    assert read.sampled == {"a": [], "b": [7, 8]} and not read.ids
    one_each = result_from_proto(result(["a", "b"], [1, 1], [7, 8]), out)
    assert one_each.ids == ["a", "b"] and one_each.tokens == [7, 8]
    for ids, counts, tokens in ((["a", "b"], [1], [7]), (["a"], [2], [7]), (["a"], [1], [7, 8])):
        with pytest.raises(MalformedResult, match="sampled tokens"):
            result_from_proto(result(ids, counts, tokens), out)


async def test_an_executor_whose_answer_breaks_the_contract_is_dropped_as_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third-party executor that counts more tokens than it sends must not crash the scheduler's engine or
    hand tokens to the wrong request: the connection treats it as lost (its requests are recomputed)."""
    from scheduler_service.core.outputs import ScheduledWork, SchedulerOutput
    from scheduler_service.core.request import Request, SamplingOptions
    from scheduler_service.engine.executor_link import ExecutorConnection, ExecutorLost

    honest = ExecutorServicer.run_step

    async def miscounting(self: ExecutorServicer, step: executor_pb2.StepRequest) -> executor_pb2.StepResult:
        result = await honest(self, step)
        result.sampled.num_tokens[0] = 2  # one token sent
        return result

    monkeypatch.setattr(ExecutorServicer, "run_step", miscounting)
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))
    server, port = await serve(backend, "127.0.0.1:0")
    try:
        connection = ExecutorConnection(f"127.0.0.1:{port}")
        request = Request("a", [65] * 4, SamplingOptions(max_tokens=2), 0.0)
        out = SchedulerOutput(step_id=1, scheduled=[ScheduledWork(request, 4, [0], is_new=True)])
        with pytest.raises(ExecutorLost, match="broke the step contract"):
            await connection.execute(out)
        await connection.close()
    finally:
        await server.stop(None)


def test_the_simulated_executor_masks_eos_and_stop_tokens_below_min_tokens() -> None:
    """min_tokens through the contract: below it the simulated model never samples EOS or a stop token (it takes
    the next printable token instead); at and past it, and with min_tokens 0, its tokens are what they always were."""
    backend = SimulatedBackend(ExecutorConfig(simulated=True, sim_eos_rate=1.0, num_gpu_blocks=16, num_cpu_blocks=4))
    eos = backend.info.eos_token_ids[0]

    def item(prompt: int, outputs: int, **sampling: object) -> BatchItem:
        tokens = [65] * (prompt + outputs)
        return BatchItem("r", tokens, prompt, 0, len(tokens), [0], True, SamplingConfig(seed=3, **sampling))  # type: ignore[arg-type]

    assert [backend.sample(item(4, k)).token_id for k in range(4)] == [eos] * 4
    masked = [backend.sample(item(4, k, min_tokens=3)).token_id for k in range(4)]
    assert eos not in masked[:3] and masked[3] == eos
    free = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4))
    natural = [free.sample(item(4, k)).token_id for k in range(4)]
    stopped = [free.sample(item(4, k, min_tokens=2, stop_token_ids=tuple(natural))).token_id for k in range(4)]
    assert not set(stopped[:2]) & set(natural) and stopped[2:] == natural[2:]


async def test_describe_advertises_the_per_step_limits_and_a_larger_step_is_refused_whole() -> None:
    config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
    s = ExecutorServicer(SimulatedBackend(config), limits=StepLimits(max_num_batched_tokens=2048, max_num_seqs=256))
    caps = (await s.Describe(executor_pb2.DescribeRequest(), None)).capabilities
    assert (caps.max_num_batched_tokens, caps.max_num_seqs, caps.max_num_lookahead_slots, caps.max_num_steps,
            caps.max_logprobs) == (2048, 256, 64, 64, 20)
    first = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0, 15])]))
    assert not first.error
    flood = executor_pb2.StepRequest(step_id=2, new_requests=[new(f"r{i}", [1 + i % 14]) for i in range(5000)])
    refused = await s.run_step(flood)
    assert refused.error == ("the step schedules 5000 requests, more than max_num_seqs 256 "
                             "(Describe.capabilities)")
    assert not refused.sampled.request_ids and set(s.table.states) == {"a"}
    running = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0])
    ok = await s.run_step(executor_pb2.StepRequest(step_id=3, running=running))
    assert not ok.error and list(ok.sampled.request_ids) == ["a"]


async def test_a_bad_sampling_value_fails_only_its_request() -> None:
    s = servicer()
    nan = new("nan", [1])
    nan.sampling.temperature = float("nan")
    result = await s.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0]), nan]))
    assert not result.error and list(result.sampled.request_ids) == ["a"]
    assert [(e.request_id, e.message) for e in result.errors] == [
        ("nan", "sampling.temperature: must be >= 0, got nan")]


def test_the_simulated_backend_keeps_nothing_per_request() -> None:
    """The simulated executor's tokens depend on (seed or request id, position) only, and it keeps nothing per
    request id once sampled (#27: it kept every unseeded request's key, ~150 bytes a request, the executor's
    growth in benchmarks/memory_soak.py)."""
    import tracemalloc
    import uuid

    from protos.contract import SamplingConfig

    backend = SimulatedBackend(ExecutorConfig(simulated=True))
    first = BatchItem("r-first", [5, 6, 7], 3, 0, 3, [0], True, SamplingConfig())
    token = backend.sample(first).token_id
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(5000):
            backend.sample(BatchItem(uuid.uuid4().hex, [5, 6, 7], 3, 0, 3, [0], True, SamplingConfig()))
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(s.size_diff for s in after.compare_to(before, "filename")
               if s.traceback[0].filename.endswith("simulated.py"))
    assert kept < 5000 * 8, f"{kept} bytes kept for 5,000 sampled requests"
    assert backend.sample(first).token_id == token


async def test_while_loading_describe_waits_for_the_backend_and_health_says_not_serving() -> None:
    """The port is open while the model loads: Describe is held until the backend is attached (so a scheduler hears
    of ready at once), or answered UNAVAILABLE ("loading") just before its deadline; health is NOT_SERVING."""
    serving = await start_serving("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            health_stub = health_pb2_grpc.HealthStub(channel)
            checked = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert checked.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as loading:
                await stub.Describe(executor_pb2.DescribeRequest(), timeout=0.5)
            assert loading.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "loading" in (loading.value.details() or "")
            waiting = asyncio.ensure_future(stub.Describe(executor_pb2.DescribeRequest(), timeout=30))
            done, _ = await asyncio.wait({waiting}, timeout=0.5)
            assert not done  # held: answered only once the backend is there
            config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
            await serving.attach(SimulatedBackend(config))
            described = await waiting
            assert described.num_device_blocks == 16 and described.block_size == 4
            checked = await health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await serving.server.stop(None)


async def test_ready_leaves_the_heap_collection_to_a_moment_later(monkeypatch: pytest.MonkeyPatch) -> None:
    """ready() attaches the backend and returns without collecting the heap (gc.collect holds the event loop for
    tens of ms on a loaded model's heap, which would delay the answer to the scheduler's held Describe); the
    collection and gc.freeze run a moment later, from the event loop."""
    from executor_service import __main__ as executor_main
    frozen = asyncio.Event()
    monkeypatch.setattr(executor_main, "freeze_heap", frozen.set)
    monkeypatch.setattr(executor_main, "FREEZE_HEAP_AFTER_S", 0.0)
    monkeypatch.setattr(executor_main.gc, "set_threshold", lambda *thresholds: None)  # leave pytest's alone
    serving = await start_serving("127.0.0.1:0")
    try:
        config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
        await executor_main.ready(config, SimulatedBackend(config), serving)
        assert not frozen.is_set()
        await asyncio.wait_for(frozen.wait(), timeout=30)
    finally:
        await serving.server.stop(None)


async def test_a_step_counts_as_in_flight_from_its_arrival_to_its_answer_over_grpc() -> None:
    """What the after-ready work waits for (activity.py, #33): the step is in flight while the backend computes it,
    and nothing is once it is answered."""
    config = ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4)
    backend = SimulatedBackend(config)
    serving = await start_serving("127.0.0.1:0")
    await serving.attach(backend)
    activity = serving.servicer.activity
    seen: list[float] = []
    real = backend.execute_async

    async def execute(items: list[BatchItem]) -> list[SampleOutput | None]:
        seen.append(activity.busy_for())
        return await real(items)

    backend.execute_async = execute  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.port}") as channel:
            call = executor_pb2_grpc.ExecutorStub(channel).Execute()
            await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]))
            answer = await call.read()
            assert answer.step_id == 1 and not answer.error
            assert len(seen) == 1 and seen[0] > 0, "the step was not in flight while the backend computed it"
            assert activity.in_flight == 0 and activity.busy_for() <= activity.quiet_s
            await call.done_writing()
    finally:
        await serving.server.stop(None)


async def test_a_message_that_does_not_parse_after_a_good_step_is_refused_after_that_steps_answer() -> None:
    """The read-ahead (read_ahead.py) reads the next message while a step runs: bytes that do not parse as a
    StepRequest, read during step 1, must neither lose step 1's answer (written while the next read ends) nor end
    the stream UNKNOWN; the stream ends INVALID_ARGUMENT naming the message after that answer."""
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))
    serving = await start_serving("127.0.0.1:0")
    await serving.attach(backend)
    real = backend.execute_async

    async def after_the_next_read(items: list[BatchItem]) -> list[SampleOutput | None]:
        follow = serving.servicer._next_message  # ReadAhead.next: its read in flight is the malformed message
        pending = follow.__self__._pending  # type: ignore[union-attr]
        assert pending is not None, "no read ahead while the step runs"
        await asyncio.wait({pending})
        return await real(items)

    backend.execute_async = after_the_next_read  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving.port}") as channel:
            call = channel.stream_stream("/pagedserve.v1.Executor/Execute", request_serializer=None,
                                         response_deserializer=executor_pb2.StepResult.FromString)()
            await call.write(executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])]).SerializeToString())
            await call.write(b"\xff\xff\xff\xff")
            first = await call.read()
            assert first.step_id == 1 and not first.error and list(first.sampled.request_ids) == ["a"]
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "StepRequest" in (ended.value.details() or "")
    finally:
        await serving.server.stop(None)


async def test_masks_that_do_not_parse_fail_their_step_and_end_the_stream_invalid_argument_not_ok() -> None:
    """The message after a token_bitmasks_follow step is its masks, read inside the step: bytes that do not parse
    fail that step (its answer says why), and the stream then ends INVALID_ARGUMENT, not OK as if the scheduler had
    half-closed it."""
    backend = SimulatedBackend(ExecutorConfig(simulated=True, num_gpu_blocks=16, num_cpu_blocks=4, block_size=4))
    server, port = await serve(backend, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.stream_stream("/pagedserve.v1.Executor/Execute", request_serializer=None,
                                         response_deserializer=executor_pb2.StepResult.FromString)()
            step = executor_pb2.StepRequest(step_id=1, new_requests=[new("a", [0])], token_bitmasks_follow=True)
            await call.write(step.SerializeToString())
            await call.write(b"\xff\xff\xff\xff")
            first = await call.read()
            assert first.step_id == 1 and "StepRequest" in first.error and not first.sampled.request_ids
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await call.read()
            assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "StepRequest" in (ended.value.details() or "")
    finally:
        await server.stop(None)
