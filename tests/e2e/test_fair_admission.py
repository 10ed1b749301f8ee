"""Admission takes turns between API keys, through the real processes: one key's flood of the waiting queue does
not hold another key's request behind all of it (the core's side: tests/core/test_fair_admission.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from client.lib import PagedServeClient
from tests.support.procs import run, running_stack, wait_until

FLOOD = 6
FLOOD_TOKENS = 200  # at 20 ms a step, each flood request runs ~4 s: the queue stays full while B is sent


async def test_a_second_keys_request_runs_second_not_behind_the_first_keys_flood(tmp_path: Path) -> None:
    """One request runs at a time (--max-num-seqs 1). Key A queues six; once five of them wait, key B sends one:
    it is admitted as soon as A's running request ends, and so finishes second. FCFS across keys finished it
    seventh, behind the whole flood."""
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "20"],
                       ["--api-key", "A", "--api-key", "B", "--max-num-seqs", "1"]) as stack:
        finished: list[str] = []

        async def call(key: str, name: str, max_tokens: int) -> None:
            async with PagedServeClient(stack.address, api_key=key) as client:
                await run(client, prompt_token_ids=[65] * 8, max_tokens=max_tokens, ignore_eos=True)
            finished.append(name)

        flood = [asyncio.create_task(call("A", f"a{i}", FLOOD_TOKENS)) for i in range(FLOOD)]
        await asyncio.to_thread(wait_until, lambda: stack.metrics()["vllm:num_requests_waiting"] == FLOOD - 1,
                                timeout=60, what="the flood queued")
        await call("B", "b", 4)
        # B's place is settled once it ends (later finishes are appended after it), so the flood requests still
        # queued (~16 s of steps) are cancelled rather than waited for.
        assert finished.index("b") == 1, finished
        for task in flood:
            task.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
