"""A /v1/completions body with a list of prompts is one call per prompt: a batch the api server cannot hold is
refused before any of it starts. Started one by one, 100,000 prompts in one body held the api server's event loop
6 s (another client's 10 ms request took 7 s) before the call past --max-queue-len + --max-num-seqs refused the
lot, and the calls that had started were aborted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from tests.support.procs import Stack, running_http_stack, wait_until

SEQS, QUEUE = 4, 4  # the api server holds at most 8 open calls
HELD = 4


async def test_a_batch_past_the_open_call_limit_is_refused_before_any_of_it_starts(tmp_path: Path) -> None:
    with running_http_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "20", "--max-num-seqs", str(SEQS)],
                            ["--max-num-seqs", str(SEQS), "--max-queue-len", str(QUEUE)]) as stack:
        url = f"{stack.http_url}/v1/completions"
        async with aiohttp.ClientSession() as http:
            async with http.post(url, json={"prompt": ["hi"] * (SEQS + QUEUE + 1), "max_tokens": 1}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "prompt", body
            held = [await http.post(url, json={"prompt": f"held {i}", "max_tokens": 40, "ignore_eos": True,
                                               "stream": True}) for i in range(HELD)]
            for response in held:  # each call is open: its first chunk came
                assert response.status == 200 and (await response.content.readline()).startswith(b"data: ")
            async with http.post(url, json={"prompt": ["hi"] * (SEQS + QUEUE - HELD + 1), "max_tokens": 1}) as r:
                body = await r.json()
                assert r.status == 429, body
            await asyncio.gather(*(response.read() for response in held))
            for response in held:
                response.release()
        await asyncio.to_thread(wait_until, lambda: finished(stack, "length") == HELD, 30, "the held calls' ends")
        assert finished(stack, "abort") == 0  # none of the refused batch had started


def finished(stack: Stack, reason: str) -> float:
    return stack.metrics().get(f"vllm:request_success_total{{{reason}}}", 0.0)
