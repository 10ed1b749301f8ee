"""Both real processes on loopback, the simulated executor, real gRPC."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import Stack, run, running_stack, wait_until

LENGTH = generation_pb2.FINISH_REASON_LENGTH


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("sim"), ["--simulated", "--num-gpu-blocks", "2048"]) as s:
        yield s


async def collect(client: PagedServeClient, prompt_len: int, max_tokens: int) -> tuple[list[int], str, int]:
    ids, text, reason, _ = await run(client, prompt_token_ids=[65 + i % 26 for i in range(prompt_len)],
                                     max_tokens=max_tokens)
    return ids, text, reason


async def test_64_concurrent_streams_finish_with_exact_lengths(stack: Stack) -> None:
    rng = random.Random(1)
    shapes = [(rng.randint(1, 700), rng.randint(1, 120)) for _ in range(64)]
    async with PagedServeClient(stack.address) as client:
        results = await asyncio.gather(*(collect(client, p, m) for p, m in shapes))
    for (_, max_tokens), (ids, text, reason) in zip(shapes, results, strict=True):
        assert reason == LENGTH
        assert len(ids) == max_tokens
        assert text == "".join(chr(i) for i in ids)
    wait_until(stack.idle, what="all blocks free")
    assert stack.metrics()["vllm:request_success_total{length}"] >= 64


async def test_cancelling_16_streams_mid_way_frees_their_blocks(stack: Stack) -> None:
    async def cancel_after(client: PagedServeClient, n: int) -> int:
        got = 0
        async for r in client.generate(prompt_token_ids=[70] * 300, max_tokens=1000, ignore_eos=True):
            got += len(r.token_ids)
            if got >= n:
                break
        return got

    async with PagedServeClient(stack.address) as client:
        done = asyncio.gather(*(collect(client, 50, 30) for _ in range(48)))
        cancelled = await asyncio.gather(*(cancel_after(client, 1 + i) for i in range(16)))
        finished = await done
    assert all(n >= 1 for n in cancelled)
    assert all(reason == LENGTH and len(ids) == 30 for ids, _, reason in finished)
    wait_until(stack.idle, what="all blocks free after cancellation")


async def test_invalid_argument_names_the_field(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate("hi", max_tokens=0):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.max_tokens" in (err.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in client.generate():
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in (err.value.details() or "")


async def test_seeded_tokens_are_reproducible(stack: Stack) -> None:
    async with PagedServeClient(stack.address) as client:
        runs = [[t async for r in client.generate("abc", max_tokens=8, seed=5) for t in r.token_ids]
                for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 8


def test_cli_generate_json(stack: Stack, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "client", "generate", "--server", stack.address,
                           "--max-tokens", "5", "--json", "hello"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert sum(len(x["token_ids"]) for x in lines) == 5
    assert [x["finish_reason"] for x in lines][-1] == "length"
    assert all(x["finish_reason"] is None for x in lines[:-1])
    bad = subprocess.run([sys.executable, "-m", "client", "generate", "--server", stack.address,
                          "--temperature", "-1", "hello"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "sampling.temperature" in bad.stderr
