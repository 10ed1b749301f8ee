"""The executor process dies mid-flight (SIGKILL) and comes back: no request is lost, no token duplicated."""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.procs import Stack, running_stack, wait_until

NUM_REQUESTS, MAX_TOKENS = 100, 64
KILL_AT = (0.1, 0.4, 0.7)


def prompts() -> list[list[int]]:
    return [[3 + (7 * i + j) % 1500 for j in range(4 + i % 29)] for i in range(NUM_REQUESTS)]


async def generate_all(stack: Stack, on_progress: object = None) -> list[tuple[list[int], int]]:
    progress = [0]

    async def one(client: PagedServeClient, prompt: list[int]) -> tuple[list[int], int]:
        ids: list[int] = []
        reason = 0
        async for r in client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                       ignore_eos=True):
            ids += r.token_ids
            reason = r.finish_reason or reason
            progress[0] += len(r.token_ids)
            if on_progress is not None:
                await on_progress(progress[0])  # type: ignore[operator]
        return ids, reason

    async with PagedServeClient(stack.address) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts()))


def test_executor_killed_three_times_loses_nothing(tmp_path: Path) -> None:
    ex = ["--num-gpu-blocks", "1024", "--num-cpu-blocks", "256"]
    with running_stack(tmp_path, ex) as stack:
        reference = asyncio.run(generate_all(stack))
        assert all(len(ids) == MAX_TOKENS for ids, _ in reference)

        total = NUM_REQUESTS * MAX_TOKENS
        pending = [int(f * total) for f in KILL_AT]
        kills = [0]
        restarting = [False]

        async def maybe_kill(done: int) -> None:
            # One restart at a time: a second kill while the first restart waits for health would kill
            # the process that restart is waiting for.
            if pending and done >= pending[0] and not restarting[0]:
                pending.pop(0)
                kills[0] += 1
                restarting[0] = True
                try:
                    await asyncio.to_thread(stack.restart_executor)
                finally:
                    restarting[0] = False

        disturbed = asyncio.run(generate_all(stack, maybe_kill))
        assert kills[0] == 3
        for (ids, reason), (ref_ids, _) in zip(disturbed, reference, strict=True):
            assert reason == generation_pb2.FINISH_REASON_LENGTH
            assert ids == ref_ids
        wait_until(lambda: stack.metrics()["pagedserve:device_blocks_used"] == 0, what="blocks free")
        assert stack.scheduler.poll() is None
