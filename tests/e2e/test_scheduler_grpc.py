"""Preemption over real gRPC: both services as processes, the simulated executor with a tiny device pool
and a tinier swap pool, so requests are swapped out and recomputed; every stream still gets exactly the
tokens of an undisturbed run with the same seeds."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import Stack, running_stack, wait_until

LENGTH = generation_pb2.FINISH_REASON_LENGTH
BLOCK_SIZE = 16
GPU_BLOCKS = 24  # 384 token slots: one request alone always fits, 16 together never do
CPU_BLOCKS = 4   # room to swap out one or two requests; the rest must recompute
SWAP = "pagedserve:num_preemptions_by_mode_total{swap}"
RECOMPUTE = "pagedserve:num_preemptions_by_mode_total{recompute}"
TOTAL = "vllm:num_preemptions_total"

Shape = tuple[int, int, int]  # (seed, prompt length, max_tokens)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    executor_args = ["--simulated", "--num-gpu-blocks", str(GPU_BLOCKS), "--num-cpu-blocks", str(CPU_BLOCKS),
                     "--block-size", str(BLOCK_SIZE), "--sim-step-latency-ms", "1"]
    scheduler_args = ["--preemption-mode", "auto", "--watermark", "0"]
    with running_stack(tmp_path_factory.mktemp("preempt"), executor_args, scheduler_args) as s:
        yield s


def shapes(n: int) -> list[Shape]:
    rng = random.Random(7)
    return [(1000 + i, rng.randint(10, 40), rng.randint(40, 80)) for i in range(n)]


async def generate(client: PagedServeClient, shape: Shape) -> tuple[list[int], str, int]:
    seed, prompt_len, max_tokens = shape
    ids: list[int] = []
    text = ""
    reason = 0
    async for r in client.generate(prompt_token_ids=[65 + (seed + i) % 26 for i in range(prompt_len)],
                                   max_tokens=max_tokens, seed=seed):
        ids += r.token_ids
        text += r.text
        reason = r.finish_reason or reason
    return ids, text, reason


def preemptions(stack: Stack) -> tuple[float, float, float]:
    m = stack.metrics()
    return m.get(SWAP, 0.0), m.get(RECOMPUTE, 0.0), m.get(TOTAL, 0.0)


def idle(stack: Stack) -> bool:
    m = stack.metrics()
    return all(m[k] == 0 for k in ("pagedserve:device_blocks_used", "pagedserve:cpu_blocks_used",
                                   "vllm:num_requests_running", "vllm:num_requests_waiting",
                                   "vllm:num_requests_swapped"))


async def test_swap_and_recompute_preemption_keep_every_stream_exact(stack: Stack) -> None:
    work = shapes(16)
    assert all(p + m <= GPU_BLOCKS * BLOCK_SIZE for _, p, m in work)
    assert sum(-(-(p + m) // BLOCK_SIZE) for _, p, m in work) > 2 * GPU_BLOCKS

    # Undisturbed: one request at a time, so none is ever preempted.
    async with PagedServeClient(stack.address) as client:
        alone = [await generate(client, shape) for shape in work]
    wait_until(lambda: idle(stack), what="idle after the undisturbed run")
    assert preemptions(stack) == (0.0, 0.0, 0.0)
    for (_, _, max_tokens), (ids, text, reason) in zip(work, alone, strict=True):
        assert reason == LENGTH and len(ids) == max_tokens
        assert text == "".join(chr(i) for i in ids)

    # All at once: the device pool runs out, requests are swapped out while the 4 swap blocks last
    # and recomputed after that; each stream must still see exactly its undisturbed tokens. "At once" need not be
    # together: in the scheduler core, arriving in any order at random steps up to 48 apart (their lives are 40-80
    # steps), each of 200 orders swapped (5 or more) and recomputed (2 or more).
    async with PagedServeClient(stack.address) as client:
        together = await asyncio.gather(*(generate(client, shape) for shape in work))
    for shape, want, got in zip(work, alone, together, strict=True):
        assert got == want, f"stream with seed {shape[0]} differs after preemption"

    wait_until(lambda: idle(stack), what="every block free after the concurrent run")
    swap, recompute, total = preemptions(stack)
    assert swap > 0, "no request was swapped out"
    assert recompute > 0, "no request was recomputed"
    assert total == swap + recompute
    m = stack.metrics()
    assert m["pagedserve:swap_out_blocks_total"] > 0
    assert m["pagedserve:swap_in_blocks_total"] == m["pagedserve:swap_out_blocks_total"]
    assert m["vllm:request_success_total{length}"] == 2 * len(work)


async def test_a_prompt_that_can_never_fit_fails_alone_and_the_rest_complete(stack: Stack) -> None:
    too_big = GPU_BLOCKS * BLOCK_SIZE + 1  # 25 blocks of 16 > 24

    async def huge(client: PagedServeClient) -> generation_pb2.GenerateResponse:
        responses = [r async for r in client.generate(prompt_token_ids=[70] * too_big, max_tokens=4)]
        assert len(responses) == 1 and not responses[0].token_ids
        return responses[0]

    small = [(2000 + i, 20, 30) for i in range(4)]
    async with PagedServeClient(stack.address) as client:
        results: list[Any] = await asyncio.gather(huge(client), *(generate(client, s) for s in small))
    failed, *rest = results
    assert failed.finish_reason == generation_pb2.FINISH_REASON_ERROR
    assert "25 KV blocks of 16 tokens" in failed.error and "at most 24 blocks" in failed.error
    assert all(reason == LENGTH and len(ids) == 30 for ids, _, reason in rest)
    wait_until(lambda: idle(stack), what="idle")
