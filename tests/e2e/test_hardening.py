"""The services attacked from outside: malformed and oversized input, calls that cannot finish, an idle
metrics port, the executor going away, two schedulers on one executor, the executor's shared secret."""

from __future__ import annotations

import asyncio
import itertools
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from client.lib import PagedServeClient, build_request
from executor_service.default_model.model import train_tokenizer
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc, generation_pb2
from tests.support.procs import (
    Stack,
    loopback,
    refusing_address,
    run,
    run_script,
    running_stack,
    start_listening,
    stop,
    thread_count,
    wait_healthy,
    wait_until,
)

STEP_MS = 20  # a request of 8000 tokens needs 160 s: it cannot finish inside any wait of these tests
FOREVER = 8000
WAIT_S = 5  # --executor-wait-timeout of the test whose executor stays away
GENERATE = "/pagedserve.v1.Generation/Generate"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("hardening"), ["--simulated", "--sim-step-latency-ms", str(STEP_MS)],
                       ["--executor-wait-timeout", "3"]) as s:
        yield s


async def raw_generate(address: str, body: bytes) -> list[generation_pb2.GenerateResponse]:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream(GENERATE, request_serializer=lambda b: b,
                                    response_deserializer=generation_pb2.GenerateResponse.FromString)
        return [r async for r in call(body)]


def listening(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def log_text(stack: Stack) -> str:
    return (stack.log_dir / "scheduler.log").read_text()


async def test_invalid_utf8_is_invalid_argument_naming_the_field_logged_at_info(stack: Stack) -> None:
    body = generation_pb2.GenerateRequest(prompt="hello", request_id="utf8").SerializeToString()
    bodies = ((body.replace(b"hello", b"hel\xfflo"), "prompt"), (b"\x0a\x05\xff\xfe\xfd\xfc\xfb", "request_id"),
              (b"\xff\xff\xff", "request"))
    for bad, field in bodies:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await raw_generate(stack.address, bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith(f"{field}: ")
    log = log_text(stack)
    assert "Traceback" not in log and " ERROR " not in log
    assert "refused a call with INVALID_ARGUMENT: prompt: not valid UTF-8" in log


async def test_every_int32_priority_is_valid(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        for priority in (-(2**31), -1, 2**31 - 1):
            ids, _, reason, error = await run(client, prompt_token_ids=[65] * 4, max_tokens=1, priority=priority)
            assert (len(ids), reason, error) == (1, generation_pb2.FINISH_REASON_LENGTH, "")


async def test_oversized_prompts_are_refused_before_any_work(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as too_big_for_grpc:
            await run(client, prompt="x" * (10 << 20), max_tokens=1)
        assert too_big_for_grpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # The simulated executor's byte tokenizer: one token per byte, so max_model_len (8192) bytes at most.
        with pytest.raises(grpc.aio.AioRpcError) as too_long:
            await run(client, prompt="y" * 8193, max_tokens=1)
        assert too_long.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert too_long.value.details() == ("prompt: 8193 bytes is more than max_model_len 8192 tokens can hold "
                                            "(at most 8192 bytes)")
        assert time.monotonic() - started < 5


async def test_a_cancelled_call_that_cannot_finish_is_aborted_and_frees_everything(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        stream = client.generate(prompt_token_ids=[65] * 40, max_tokens=FOREVER, ignore_eos=True,
                                 request_id="cancel-me")
        first = await anext(stream)
        assert first.token_ids
        assert stack.metrics()["vllm:num_requests_running"] == 1
        await stream.aclose()  # cancels the call
        wait_until(stack.idle, timeout=30, what="blocks freed and running at 0 after the cancel")


async def test_an_expired_deadline_on_a_call_that_cannot_finish_aborts_it(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as expired:
            await run(client, prompt_token_ids=[66] * 40, max_tokens=FOREVER, ignore_eos=True, timeout=0.5)
        assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(stack.idle, timeout=30, what="blocks freed and running at 0 after the deadline")


async def test_a_duplicate_request_id_is_already_exists(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        first = client.generate(prompt_token_ids=[67] * 4, max_tokens=FOREVER, ignore_eos=True, request_id="dup")
        await anext(first)
        with pytest.raises(grpc.aio.AioRpcError) as duplicate:
            await run(client, prompt_token_ids=[67] * 4, max_tokens=2, request_id="dup")
        assert duplicate.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "dup" in (duplicate.value.details() or "")
        await first.aclose()
    wait_until(stack.idle, timeout=30, what="idle")


async def test_one_log_line_per_finished_request(stack: Stack) -> None:
    ids = [f"line-{i}" for i in range(4)]
    async with PagedServeClient(stack.address) as client:
        await asyncio.gather(*(run(client, prompt_token_ids=[68] * 4, max_tokens=3, request_id=rid) for rid in ids))
        cancelled = client.generate(prompt_token_ids=[68] * 4, max_tokens=FOREVER, request_id="line-cancel")
        await anext(cancelled)
        await cancelled.aclose()
    wait_until(lambda: "request line-cancel finished: reason=abort" in log_text(stack), timeout=30,
               what="the cancelled request's line")
    log = log_text(stack)
    for rid in [*ids, "line-cancel"]:
        assert log.count(f"request {rid} finished:") == 1, rid
    assert all(f"request {rid} finished: reason=length prompt_tokens=4 output_tokens=3" in log for rid in ids)


async def test_the_simulated_executor_returns_logprobs(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        responses = [r async for r in client.generate(prompt_token_ids=[69] * 4, max_tokens=3, logprobs=2)]
    tokens = [t for r in responses for t in r.token_ids]
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == tokens and len(tokens) == 3
    assert all(lp.logprob == 0.0 and [t.token_id for t in lp.top] == [lp.token_id] for lp in logprobs)


def test_idle_metrics_connections_cost_no_thread(stack: Stack) -> None:
    before = thread_count(stack.scheduler)
    conns = [socket.create_connection(("127.0.0.1", stack.metrics_port)) for _ in range(300)]
    try:
        assert stack.metrics()["vllm:num_requests_running"] == 0
        assert thread_count(stack.scheduler) <= before + 1
    finally:
        for c in conns:
            c.close()


def test_new_calls_without_an_executor_end_unavailable_after_the_wait(tmp_path: Path) -> None:
    with refusing_address() as nowhere:
        proc, ports = start_listening("scheduler_service", ["--executor", nowhere, "--metrics-port", "-1",
                                                            "--executor-wait-timeout", "1"], tmp_path / "scheduler.log")
        ends_unavailable_after_the_wait(loopback(ports["listen"]), proc)


def ends_unavailable_after_the_wait(address: str, proc: subprocess.Popen[bytes]) -> None:
    async def call() -> tuple[grpc.StatusCode, str, float]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = executor_stub_generation(channel)
            await asyncio.wait_for(channel.channel_ready(), 60)  # the api server process is up: time from here
            started = time.monotonic()
            try:
                async for _ in stub(build_request(prompt_token_ids=[65], max_tokens=1), wait_for_ready=True,
                                    timeout=30):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or "", time.monotonic() - started
        return grpc.StatusCode.OK, "", 0.0

    try:
        code, details, waited = asyncio.run(call())
        assert code == grpc.StatusCode.UNAVAILABLE
        assert details == "no executor connected within --executor-wait-timeout 1.0s; retry later"
        assert waited < 5
    finally:
        stop(proc)


def executor_stub_generation(channel: grpc.aio.Channel):
    return channel.unary_stream(GENERATE, request_serializer=generation_pb2.GenerateRequest.SerializeToString,
                                response_deserializer=generation_pb2.GenerateResponse.FromString)


def test_in_flight_requests_end_unavailable_when_the_executor_stays_away(tmp_path: Path) -> None:
    # The gauges are read while the request waits, so the wait (WAIT_S) is long next to a metrics read on a loaded
    # machine; past it the request must end at once.
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", str(STEP_MS)],
                       ["--executor-wait-timeout", str(WAIT_S)]) as stack:

        async def go() -> None:
            async with PagedServeClient(stack.address) as client:
                stream = client.generate(prompt_token_ids=[65] * 40, max_tokens=FOREVER, ignore_eos=True)
                await anext(stream)
                killed = time.monotonic()  # before the kill: the scheduler's wait starts when it sees the stream break,
                stop(stack.executor, signal.SIGKILL)  # which may be before stop() has reaped the process
                # The gauges follow at once: the request waits for an executor, none runs.
                wait_until(lambda: stack.metrics()["vllm:num_requests_running"] == 0
                           and stack.metrics()["vllm:num_requests_waiting"] == 1, timeout=WAIT_S, what="gauges")
                with pytest.raises(grpc.aio.AioRpcError) as lost:
                    async for _ in stream:
                        pass
                assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
                assert (lost.value.details() or "").startswith("no executor for ")
                assert WAIT_S <= time.monotonic() - killed < WAIT_S + 4
                wait_until(stack.idle, timeout=30, what="gauges at 0")
                assert stack.metrics()["pagedserve:requests_refused_total{UNAVAILABLE}"] == 1

        asyncio.run(go())


def test_one_scheduler_at_a_time_and_a_hung_one_is_replaced_within_seconds(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "2"],
                       ["--executor-wait-timeout", "2"]) as stack:
        second, ports = start_listening("scheduler_service", ["--executor", stack.executor_address,
                                                              "--metrics-port", "-1", "--executor-wait-timeout", "20"],
                                        tmp_path / "second.log")
        second_address = loopback(ports["listen"])
        try:
            wait_until(lambda: listening(second_address), timeout=30, what="the second scheduler's port")
            asyncio.run(_two_schedulers(stack, second_address, second))
        finally:
            if stack.scheduler.poll() is None:
                stack.scheduler.send_signal(signal.SIGCONT)
            stop(second)
    assert "superseded" not in (tmp_path / "scheduler.log").read_text()
    assert "FAILED_PRECONDITION: this executor already serves a scheduler" in (tmp_path / "second.log").read_text()


async def _two_schedulers(stack: Stack, second_address: str, second: object) -> None:
    async with PagedServeClient(stack.address) as first, PagedServeClient(second_address) as other:
        await run(first, prompt_token_ids=[65] * 4, max_tokens=4)  # the first scheduler holds the stream
        results: tuple[Any, ...] = await asyncio.gather(
            run(first, prompt_token_ids=[65] * 4, max_tokens=200, ignore_eos=True),
            _expect_error(other, timeout=2), return_exceptions=True)
        served, refused = results
        assert not isinstance(served, BaseException)
        assert len(served[0]) == 200 and served[3] == "", "the second scheduler must not disturb the first"
        assert refused == grpc.StatusCode.DEADLINE_EXCEEDED, "the second scheduler cannot serve meanwhile"
        stack.scheduler.send_signal(signal.SIGSTOP)  # hung: its connection stays open, pings go unanswered
        hung = time.monotonic()
        ids, _, _, error = await run(other, prompt_token_ids=[65] * 4, max_tokens=4, timeout=30)
        assert (len(ids), error) == (4, "")
        assert time.monotonic() - hung < 12


async def _expect_error(client: PagedServeClient, timeout: float) -> grpc.StatusCode:
    try:
        await run(client, prompt_token_ids=[65] * 4, max_tokens=4, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_the_executor_secret(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-value\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("guess\n")
    with running_stack(tmp_path, ["--simulated", "--executor-secret-file", str(secret)],
                       ["--executor-secret-file", str(secret)]) as stack:

        async def go() -> None:
            async with PagedServeClient(stack.address) as client:
                ids, *_ = await run(client, prompt_token_ids=[65] * 4, max_tokens=3)
                assert len(ids) == 3
            async with grpc.aio.insecure_channel(stack.executor_address) as channel:
                stub = executor_pb2_grpc.ExecutorStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as denied:
                    await stub.Describe(executor_pb2.DescribeRequest(), timeout=5)
                assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
                call = stub.Execute(metadata=(("x-pagedserve-executor-secret", "guess"),))
                with pytest.raises(grpc.aio.AioRpcError) as denied_stream:
                    await call.read()
                assert denied_stream.value.code() == grpc.StatusCode.UNAUTHENTICATED

        asyncio.run(go())
        intruder, ports = start_listening("scheduler_service", [
            "--executor", stack.executor_address, "--metrics-port", "-1", "--executor-secret-file", str(wrong)],
            tmp_path / "intruder.log")
        wrong_address = loopback(ports["listen"])
        try:
            wait_until(lambda: "UNAUTHENTICATED" in (tmp_path / "intruder.log").read_text(), timeout=20,
                       what="the intruder refused")
            with pytest.raises(TimeoutError):
                wait_healthy(wrong_address, intruder, timeout=1)
        finally:
            stop(intruder)


def test_a_step_the_executor_refuses_fails_its_requests(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated"], ["--num-scheduler-steps", "65"]) as stack:

        async def go() -> tuple[list[int], str, int, str]:
            async with PagedServeClient(stack.address) as client:
                return await run(client, prompt_token_ids=[65] * 4, max_tokens=100, ignore_eos=True)

        _, _, reason, error = asyncio.run(go())
        assert reason == generation_pb2.FINISH_REASON_ERROR
        assert error == "executor refused the step: num_steps 65 exceeds max_num_steps 64 (Describe.capabilities)"
        wait_until(stack.idle, timeout=30, what="idle")


def test_a_canary_stream_keeps_flowing_while_huge_prompts_arrive(tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text(train_tokenizer().to_str())
    executor = ["--simulated", "--sim-vocab-size", "2048", "--sim-max-model-len", "100000",
                "--sim-step-latency-ms", "5"]
    with running_stack(tmp_path, executor, ["--tokenizer", str(tokenizer_dir)]) as stack:
        gap, codes = asyncio.run(_canary(stack))
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2  # 10 MB: over the request size limit
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) == 2  # ~1.3 MB: tokenized, then too many tokens
    assert gap < 1.0, f"the canary stream stalled for {gap:.2f}s"


ATTACK = """
import asyncio, sys
import grpc
from client.lib import PagedServeClient

async def main(address):
    text = "the quick brown fox \u65e5\u672c\u8a9e jumps over the lazy dog; "
    huge = text * ((10 << 20) // len(text.encode()) + 1)
    large = text * ((1300 << 10) // len(text.encode()))
    async with PagedServeClient(address) as client:
        async def one(prompt):
            try:
                async for _ in client.generate(prompt=prompt, max_tokens=1):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code().name
            return "OK"
        print(*await asyncio.gather(*(one(p) for p in (huge, large, huge, large))))

asyncio.run(main(sys.argv[1]))
"""


async def _canary(stack: Stack) -> tuple[float, list[grpc.StatusCode]]:
    """The canary's largest gap between tokens while another process sends the huge prompts (so the
    attacker's own work does not stall the canary's reader)."""
    async with PagedServeClient(stack.address) as client:
        canary = client.generate(prompt_token_ids=[65] * 4, max_tokens=20_000, ignore_eos=True)
        await anext(canary)
        arrivals: list[float] = []
        stop_canary = asyncio.Event()

        async def watch() -> None:
            async for _ in canary:
                arrivals.append(time.monotonic())
                if stop_canary.is_set():
                    break

        watcher = asyncio.create_task(watch())
        out = await run_script(ATTACK, stack.address)
        await asyncio.sleep(0.2)  # a few more canary tokens after the last attack
        stop_canary.set()
        await watcher
        await canary.aclose()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return max(gaps), [grpc.StatusCode[name] for name in out.decode().split()]
