"""Sliding-window KV cache groups through real processes: the scheduler service against a simulated executor
that advertises window groups (it checks and tracks the window tables with the torch executor's validator), with a
pool small enough that requests are preempted; the seeded tokens are those of a simulated executor with one table,
no step is refused, and every block is free afterwards; with tables released block by block, with rings
(--sim-kv-window-ring, Capabilities.kv_window_ring), and window-only (--sim-kv-window-only: every layer slides, one
ring per request and no block table)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc, generation_pb2
from tests.support.procs import Stack, run, running_stack, wait_until

SCHEDULER = ["--max-num-batched-tokens", "64"]
SHAPES = [(40 + 37 * i, 30 + 11 * i) for i in range(12)]  # prompts and outputs longer than the window
BLOCKS, BLOCK, WINDOW = 150, 16, 24
PAIR_PROMPT, PAIR_OUTPUT = 40 * BLOCK, 56 * BLOCK
"""One request with n = 2, alone on the stack, preempts for certain by block arithmetic, in any order of steps: its
sibling joins the queue's front once the prompt is computed and, with nothing else running, is admitted at once
(40 shared prompt blocks + one each is far below 150). From then on each sequence's own blocks grow in lockstep to
56 full-attention blocks past the shared 40, plus at least 2 window blocks in each of the 2 window groups (its
last 24 positions span 2 blocks; a ring keeps 3): 40 + 2 * (56 + 4) = 160 > 150, while one sequence alone
(40 + 56 + 6 = 102) fits. So one of them is preempted (swapped or recomputed) at least once."""


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("plain"), ["--simulated"], SCHEDULER) as stack:
        yield stack


KINDS = {"released": ["--sim-kv-window-groups", "2"],
         "rings": ["--sim-kv-window-groups", "2", "--sim-kv-window-ring"],
         # a ring of ceil(24 / 16) + 1 = 3 blocks each: 20 blocks hold 6 requests of the 12
         "window-only": ["--sim-kv-window-groups", "1", "--sim-kv-window-ring", "--sim-kv-window-only"]}


@pytest.fixture(scope="module", params=list(KINDS))
def stacks(request: pytest.FixtureRequest, plain: Stack,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    blocks = 20 if request.param == "window-only" else BLOCKS
    hybrid = ["--simulated", "--num-gpu-blocks", str(blocks), "--num-cpu-blocks", "64", "--block-size", str(BLOCK),
              "--sim-kv-window", str(WINDOW), *KINDS[request.param]]
    with running_stack(tmp_path_factory.mktemp("hybrid"), hybrid, SCHEDULER) as with_groups:
        yield with_groups, plain


async def generate(address: str) -> list[tuple[list[int], int, str]]:
    async with PagedServeClient(address) as client:
        results = await asyncio.gather(*(run(client, prompt_token_ids=[5 + (i + j) % 90 for j in range(p)],
                                             max_tokens=m, seed=i, ignore_eos=True)
                                         for i, (p, m) in enumerate(SHAPES)))
    return [(ids, reason, error) for ids, _, reason, error in results]


async def test_window_groups_give_the_tokens_of_one_table_under_preemption(stacks: tuple[Stack, Stack]) -> None:
    with_groups, plain = stacks
    async with grpc.aio.insecure_channel(with_groups.executor_address) as channel:
        describe = await executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest())
    only = "--sim-kv-window-only" in with_groups.executor_args
    assert (describe.capabilities.kv_window_groups, describe.capabilities.kv_window) == (1 if only else 2, 24)
    assert describe.capabilities.kv_window_ring == ("--sim-kv-window-ring" in with_groups.executor_args)
    assert describe.capabilities.kv_window_only == only
    ours, theirs = await generate(with_groups.address), await generate(plain.address)
    for (ids, reason, error), (ref, _, _), (_, m) in zip(ours, theirs, SHAPES, strict=True):
        assert not error and reason == generation_pb2.FINISH_REASON_LENGTH and len(ids) == m
        assert ids == ref
    wait_until(with_groups.idle, what="every block free")
    before = with_groups.metrics()["vllm:num_preemptions_total"]
    assert await generate_pair(with_groups.address) == await generate_pair(plain.address)
    if not only:  # a window-only sequence holds its ring of 3 blocks from admission on: it never grows
        assert with_groups.metrics()["vllm:num_preemptions_total"] > before, "the pair outgrows the pool (PAIR_PROMPT)"
    wait_until(with_groups.idle, what="every block free")


async def generate_pair(address: str) -> dict[int, list[int]]:
    """The two sequences of the n = 2 request, by index."""
    sequences: dict[int, list[int]] = {0: [], 1: []}
    async with PagedServeClient(address) as client:
        async for r in client.generate(prompt_token_ids=[7 + j % 80 for j in range(PAIR_PROMPT)], n=2, seed=99,
                                       max_tokens=PAIR_OUTPUT, ignore_eos=True):
            assert not r.error, r.error
            sequences[r.index] += r.token_ids
    assert [len(ids) for ids in sequences.values()] == [PAIR_OUTPUT, PAIR_OUTPUT]
    return sequences
