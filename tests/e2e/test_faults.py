"""The executor process dies mid-flight (SIGKILL) and comes back: no request is lost, no token duplicated."""

from __future__ import annotations

import asyncio
from pathlib import Path

from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import generate_all, running_stack, wait_until

NUM_REQUESTS, MAX_TOKENS = 100, 64
# Fractions of all tokens streamed before each kill. Each restart waits for the new executor's health,
# and the scheduler may finish what is left before that wait returns: the last kill leaves half the run.
KILL_AT = (0.1, 0.3, 0.5)


def test_executor_killed_three_times_loses_nothing(tmp_path: Path) -> None:
    ex = ["--num-gpu-blocks", "1024", "--num-cpu-blocks", "256"]
    with running_stack(tmp_path, ex) as stack:
        reference = asyncio.run(generate_all(stack.address, NUM_REQUESTS, MAX_TOKENS))
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

        disturbed = asyncio.run(generate_all(stack.address, NUM_REQUESTS, MAX_TOKENS, maybe_kill))
        assert kills[0] == 3, f"the run ended after {kills[0]} kills"
        for (ids, reason), (ref_ids, _) in zip(disturbed, reference, strict=True):
            assert reason == generation_pb2.FINISH_REASON_LENGTH
            assert ids == ref_ids
        wait_until(lambda: stack.metrics()["pagedserve:device_blocks_used"] == 0, what="blocks free")
        assert stack.scheduler.poll() is None
