"""A gRPC client that stops reading its Generate stream (#F2): gRPC's flow control holds the server's write, and
after --grpc-write-timeout the handler is cancelled, its request aborted (its blocks freed) and its place among the
open calls freed. (gRPC sends the client nothing more: no status can follow the held message, and grpc.aio gives a
handler no way to reset its stream; the client's HTTP/2 stream stays until it or its connection goes.)
Before, --max-stream-buffer aborted the request but the call stayed open for as long as the client held its
connection, counted among the open calls: with the limit's worth of them (here 2: --max-queue-len 1 +
--max-num-seqs 1) every new call was refused RESOURCE_EXHAUSTED (too many open calls)."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from tests.support.procs import Stack, run, running_stack, wait_until

STALLED_TOKENS = 90_000  # ~90 s of 1 ms steps: run to its end, it would outlast the test's wait
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]  # its window never grows


def left_the_queue(stack: Stack, calls: int) -> bool:
    """Whether `calls` requests have left the waiting queue: running, or already aborted."""
    metrics = stack.metrics()
    return metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:request_success_total{abort}", 0) == calls


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    executor = ["--simulated", "--sim-max-model-len", "100000", "--sim-step-latency-ms", "1"]
    scheduler = ["--max-queue-len", "1", "--max-num-seqs", "1", "--api-server-count", "1",
                 "--grpc-write-timeout", "1", "--max-stream-buffer", "1000000"]
    with running_stack(tmp_path, executor, scheduler) as s:
        yield s


async def test_calls_whose_client_stops_reading_end_and_free_their_place(stack: Stack) -> None:
    channels = [grpc.aio.insecure_channel(stack.address, options=SMALL_WINDOW) for _ in range(2)]
    calls = []
    try:
        for i, channel in enumerate(channels):
            request = generation_pb2.GenerateRequest(request_id=f"stalled-{i}", prompt_token_ids=[65, 66])
            request.sampling.max_tokens = STALLED_TOKENS
            request.sampling.ignore_eos = True
            calls.append(generation_pb2_grpc.GenerationStub(channel).Generate(request))
            await calls[-1].initial_metadata()  # the call is open; its responses are never read
            # the first leaves the 1-long waiting queue (running, or already aborted) before the second arrives
            wait_until(functools.partial(left_the_queue, stack, i + 1), what="the call's request out of the queue")
        wait_until(lambda: stack.metrics().get("vllm:request_success_total{abort}", 0) == 2 and stack.idle(),
                   timeout=60, what="both stalled requests aborted and their blocks freed")
        async with PagedServeClient(stack.address) as client:  # the calls left the open-call count as they ended
            ids, _, _, error = await run(client, prompt_token_ids=[65] * 3, max_tokens=4, ignore_eos=True)
        assert len(ids) == 4 and not error
        log = (stack.log_dir / "scheduler.log").read_text()
        assert log.count("its client read no response for --grpc-write-timeout 1s") == 2
        assert "Traceback" not in log
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
