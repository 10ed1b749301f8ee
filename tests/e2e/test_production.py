"""Production behaviour over the real processes: drain on SIGTERM, backpressure, cancellation, fuzzing,
stop strings."""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.lib import PagedServeClient
from protos.pagedserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.support.procs import Stack, run, running_stack, wait_until

LENGTH, STOP, ABORT = (generation_pb2.FINISH_REASON_LENGTH, generation_pb2.FINISH_REASON_STOP,
                       generation_pb2.FINISH_REASON_ABORT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("prod"), ["--simulated", "--num-gpu-blocks", "1024"]) as s:
        yield s


async def test_half_of_100_streams_cancelled_leave_nothing_held(stack: Stack) -> None:
    rng = random.Random(7)

    async def maybe_cancel(client: PagedServeClient, i: int) -> None:
        stop_after = rng.randint(1, 60) if i % 2 else None
        got = 0
        async for r in client.generate(prompt_token_ids=[40 + i % 50] * rng.randint(1, 200), max_tokens=64):
            got += len(r.token_ids)
            if stop_after is not None and got >= stop_after:
                return
        assert got == 64

    async with PagedServeClient(stack.address) as client:
        await asyncio.gather(*(maybe_cancel(client, i) for i in range(100)))
    wait_until(stack.idle, what="no block or request held after cancellations")


async def test_expired_deadline_aborts_and_frees(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await run(client, prompt="x", max_tokens=8000, ignore_eos=True, timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(stack.idle, what="blocks freed after the deadline")


async def test_stop_string_across_tokens_is_not_emitted(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        ids, full, reason, _ = await run(client, prompt="q", max_tokens=40, seed=11)
        assert reason == LENGTH and len(full) == 40
        stop = full[20:23]
        expected = full[:full.find(stop)]
        ids2, text, reason2, _ = await run(client, prompt="q", max_tokens=40, seed=11, stop=[stop])
    assert reason2 == STOP
    assert text == expected
    assert ids2 == ids[:len(ids2)] and len(ids2) == full.find(stop) + len(stop)


async def test_stop_token_ids_and_min_tokens(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        ids, _, _, _ = await run(client, prompt="q", max_tokens=30, seed=3)
        target = ids[10]
        first = ids.index(target)
        got, _, reason, _ = await run(client, prompt="q", max_tokens=30, seed=3, stop_token_ids=[target])
        assert reason == STOP and got == ids[:first + 1]
        got, _, reason, _ = await run(client, prompt="q", max_tokens=30, seed=3, stop_token_ids=[target],
                                      min_tokens=first + 2)
        assert len(got) > first + 1


async def test_n_sequences_stream_with_their_index(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        per_index: dict[int, list[int]] = {}
        finals = 0
        ids = set()
        async for r in client.generate("hi", max_tokens=5, n=3, seed=1):
            per_index.setdefault(r.index, []).extend(r.token_ids)
            finals += bool(r.finish_reason)
            ids.add(r.request_id)
    assert sorted(per_index) == [0, 1, 2] and finals == 3
    assert len(ids) == 1 and "#" not in ids.pop(), "every sequence reports the call's one request id"
    assert all(len(v) == 5 for v in per_index.values())
    assert len({tuple(v) for v in per_index.values()}) == 3


def test_overload_gets_resource_exhausted_and_admitted_complete(tmp_path: Path) -> None:
    # Full by construction, not by a burst that might not overlap on a loaded machine: two requests that cannot
    # finish (8000 tokens at 20 ms a step) take both running slots, four wait in the queue, and only then come
    # the calls that must be refused. The two are then cancelled, and the four run to the end.
    ex = ["--simulated", "--sim-step-latency-ms", "20"]
    sc = ["--max-queue-len", "4", "--max-num-seqs", "2"]
    with running_stack(tmp_path, ex, sc) as s:
        async def attempt(client: PagedServeClient) -> str:
            try:
                ids, _, reason, _ = await run(client, prompt="x", max_tokens=10)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                return "refused"
            assert reason == LENGTH and len(ids) == 10
            return "done"

        async def main() -> tuple[list[str], list[str]]:
            async with PagedServeClient(s.address) as client:
                hogs = [client.generate(prompt="x", max_tokens=8000, ignore_eos=True) for _ in range(2)]
                for hog in hogs:
                    await anext(hog)
                queued = [asyncio.create_task(attempt(client)) for _ in range(4)]
                await asyncio.to_thread(wait_until, lambda: s.metrics()["vllm:num_requests_waiting"] == 4, 30.0,
                                        "four requests waiting behind the two running")
                over = await asyncio.wait_for(asyncio.gather(*(attempt(client) for _ in range(5))), 30)
                for hog in hogs:
                    await hog.aclose()
                return over, await asyncio.gather(*queued)

        over, admitted = asyncio.run(main())
        assert over == ["refused"] * 5 and admitted == ["done"] * 4
        wait_until(s.idle, what="drained after overload")


def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "10"]) as s:
        async def main() -> list[tuple[list[int], str, int, str]]:
            async with PagedServeClient(s.address) as client:
                tasks = [asyncio.create_task(run(client, prompt="x", max_tokens=60)) for _ in range(8)]
                async for _ in client.generate("y", max_tokens=1):
                    pass
                s.scheduler.send_signal(signal.SIGTERM)
                await asyncio.to_thread(wait_until, lambda: not serving(s.address), 10.0, "NOT_SERVING")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await run(client, prompt="z", max_tokens=2)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                return await asyncio.gather(*tasks)

        results = asyncio.run(main())
        assert all(reason == LENGTH and len(ids) == 60 for ids, _, reason, _ in results)
        assert s.scheduler.wait(timeout=30) == 0


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tmp_path: Path) -> None:
    ex = ["--simulated", "--sim-step-latency-ms", "10"]
    with running_stack(tmp_path, ex, ["--shutdown-timeout", "0.3"]) as s:
        async def main() -> tuple[list[int], str, int, str]:
            async with PagedServeClient(s.address) as client:
                task = asyncio.create_task(run(client, prompt="x", max_tokens=5000, ignore_eos=True))
                async for _ in client.generate("y", max_tokens=1):
                    pass
                s.scheduler.send_signal(signal.SIGTERM)
                return await task

        ids, _, reason, error = asyncio.run(main())
        assert reason == ABORT and "shut down" in error and 0 < len(ids) < 5000
        assert s.scheduler.wait(timeout=30) == 0


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


sampling_fields = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(0, 20000),
    "min_tokens": st.integers(0, 50),
    "temperature": st.floats(-2, 5) | st.just(float("nan")) | st.just(float("inf")),
    "top_p": st.floats(-1, 2) | st.just(float("nan")),
    "top_k": st.integers(-5, 100),
    "min_p": st.floats(-1, 2) | st.just(float("nan")),
    "seed": st.integers(0, 2**64 - 1),
    "stop": st.lists(st.text(max_size=300), max_size=20),
    "stop_token_ids": st.lists(st.integers(0, 70000), max_size=5),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3) | st.just(float("nan")),
    "logprobs": st.integers(0, 50),
    "n": st.integers(0, 20),
    "priority": st.integers(-(2**31), 2**31 - 1),
})
requests = st.builds(
    lambda prompt, ids, sampling, rid: generation_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=ids, request_id=rid,
        sampling=common_pb2.SamplingParams(**{k: v for k, v in sampling.items()
                                              if not (k == "max_tokens" and v > 40)})),
    st.text(max_size=50), st.lists(st.integers(0, 70000), max_size=20), sampling_fields,
    st.sampled_from(["", "", "x" * 300]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=requests)
def test_fuzzed_requests_succeed_or_get_invalid_argument(stack: Stack, req: generation_pb2.GenerateRequest) -> None:
    with grpc.insecure_channel(stack.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        try:
            responses = list(stub.Generate(req, timeout=30))
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
            assert e.details()
            return
    finals = [r for r in responses if r.finish_reason]
    assert len(finals) == (req.sampling.n if req.sampling.HasField("n") else 1)


def test_server_healthy_after_fuzzing(stack: Stack) -> None:
    assert serving(stack.address)
    with grpc.insecure_channel(stack.address) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        req = generation_pb2.GenerateRequest(prompt="ok", sampling=common_pb2.SamplingParams(max_tokens=3))
        assert sum(len(r.token_ids) for r in stub.Generate(req, timeout=30)) == 3
    wait_until(stack.idle, what="idle after fuzzing")


def test_stop_strings_with_multi_step_cut_tokens_respect_min_tokens_and_count_in_metrics(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated"], ["--num-scheduler-steps", "4"]) as s:
        async def main() -> None:
            async with PagedServeClient(s.address) as client:
                ids, full, _, _ = await run(client, prompt="q", max_tokens=40, seed=21)
                stop = full[9]
                first = full.index(stop)
                got, text, reason, _ = await run(client, prompt="q", max_tokens=40, seed=21, stop=[stop])
                assert reason == STOP and text == full[:first] and got == ids[:first + 1]
                later = full.index(stop, first + 1) if stop in full[first + 1:] else None
                got, text, reason, _ = await run(client, prompt="q", max_tokens=40, seed=21, stop=[stop],
                                                 min_tokens=first + 2)
                if later is None:
                    assert reason == LENGTH and text == full
                else:
                    assert reason == STOP and text == full[:later] and got == ids[:later + 1]
                last_char = full[-1]
                if last_char not in full[:-1]:
                    _, text, reason, _ = await run(client, prompt="q", max_tokens=40, seed=21, stop=[last_char])
                    assert reason == STOP and text == full[:-1]

        before = s.metrics().get("vllm:request_success_total{stop}", 0)
        asyncio.run(main())
        wait_until(lambda: s.metrics().get("vllm:request_success_total{stop}", 0) >= before + 2,
                   what="stop-string finishes counted")


def last_only_suffix(text: str) -> str:
    """The shortest suffix of text found nowhere earlier in it: as a stop string, only the last character
    completes it."""
    return next(text[-n:] for n in range(1, len(text) + 1) if text.find(text[-n:]) == len(text) - n)


@pytest.mark.parametrize("api_servers", ["0", "1"])
def test_a_stop_string_completed_by_the_last_allowed_token_is_counted_as_stop(tmp_path: Path,
                                                                             api_servers: str) -> None:
    """max_tokens ends the request in the core (LENGTH) at the very token that completes a stop string: the
    answer is `stop`, and vllm:request_success_total must say `stop` too, in both process layouts. A
    stop-string request that ends by length is still counted `length`."""
    success = "vllm:request_success_total{%s}"
    with running_stack(tmp_path, ["--simulated"], ["--api-server-count", api_servers]) as s:
        def counted(reason: str) -> float:
            return s.metrics().get(success % reason, 0)

        async def one(**kwargs: object) -> tuple[list[int], str, int, str]:
            async with PagedServeClient(s.address) as client:
                return await run(client, prompt="q", max_tokens=12, seed=21, **kwargs)

        ids, full, reason, _ = asyncio.run(one())
        assert reason == LENGTH and len(full) == 12
        wait_until(lambda: counted("length") == 1, what="the plain run counted")
        stop = last_only_suffix(full)
        got, text, reason, _ = asyncio.run(one(stop=[stop]))
        assert (reason, text, got) == (STOP, full[:-len(stop)], ids)
        wait_until(lambda: counted("stop") == 1, what="the stop-string finish counted as stop")
        assert counted("length") == 1
        _, text, reason, _ = asyncio.run(one(stop=["never in the text \u2603"]))
        assert (reason, text) == (LENGTH, full)
        wait_until(lambda: counted("length") == 2, what="the unmatched stop-string request counted as length")
        assert counted("stop") == 1


def test_scheduler_without_executor_shuts_down_at_once(tmp_path: Path) -> None:
    from tests.support.procs import refusing_address, start

    with refusing_address() as nowhere:
        proc = start("scheduler_service", ["--listen", "127.0.0.1:0", "--executor", nowhere, "--metrics-port", "-1"],
                     tmp_path / "s.log")
        wait_until(lambda: "waiting for executor" in (tmp_path / "s.log").read_text(), what="listening")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
