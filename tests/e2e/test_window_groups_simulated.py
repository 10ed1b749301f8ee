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


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("plain"), ["--simulated"], SCHEDULER) as stack:
        yield stack


KINDS = {"released": ["--sim-kv-window-groups", "2"],
         "rings": ["--sim-kv-window-groups", "2", "--sim-kv-window-ring"],
         # a ring of ceil(24 / 16) + 1 = 3 blocks each: 20 blocks hold 6 requests of the 12
         "window-only": ["--sim-kv-window-groups", "1", "--sim-kv-window-ring", "--sim-kv-window-only",
                         "--num-gpu-blocks", "20"]}


@pytest.fixture(scope="module", params=list(KINDS))
def stacks(request: pytest.FixtureRequest, plain: Stack,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Stack]]:
    hybrid = ["--simulated", "--num-gpu-blocks", "150", "--num-cpu-blocks", "64", "--sim-kv-window", "24",
              *KINDS[request.param]]
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
    metrics = with_groups.metrics()
    if not describe.capabilities.kv_window_ring:  # rings hold fewer blocks: whether this workload preempts them
        assert metrics["vllm:num_preemptions_total"] > 0  # depends on arrival order (test_kv_window_groups.py does)
    wait_until(with_groups.idle, what="every block free")
