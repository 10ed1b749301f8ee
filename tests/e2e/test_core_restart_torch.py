"""A SIGKILLed engine core under a real model (#28): the torch executor's seeded sampling, penalties and logprobs
continue on the restarted core exactly as in an undisturbed run (the simulated executor ignores sampling, so only
a model can tell whether a continuation's positions, seeds and output tokens are right)."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest

from client.lib import PagedServeClient
from executor_service.default_model.model import TOKENIZER_VOCAB_SIZE, make_model
from tests.support.tiers import running_tiers

MAX_TOKENS = 64
CALLS: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.9, "seed": 7, "top_k": 40, "presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"temperature": 1.0, "seed": 8, "repetition_penalty": 1.3, "n": 2},
    {"temperature": 0.8, "seed": 9, "top_p": 0.9, "logprobs": 2, "min_tokens": 8},
]

Result = dict[tuple[int, int], tuple[list[int], list[tuple[int, float]], int, int]]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("resume") / "llama", hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, vocab_size=TOKENIZER_VOCAB_SIZE, init_std=0.2, seed=11)


async def run_calls(address: str, quarter: asyncio.Event | None = None) -> Result:
    out: Result = {}
    seen = [0]
    total = sum(c.get("n", 1) for c in CALLS) * MAX_TOKENS * 3

    async def one(client: PagedServeClient, i: int, params: dict[str, Any]) -> None:
        prompt = [5 + (13 * i + 7 * j) % 400 for j in range(20 + i)]
        async for r in client.generate(prompt_token_ids=prompt, request_id=f"t{i}", max_tokens=MAX_TOKENS,
                                       ignore_eos=True, timeout=120, **params):
            ids, lps, _, _ = out.get((i, r.index), ([], [], 0, 0))
            ids = ids + list(r.token_ids)
            lps = lps + [(lp.token_id, lp.logprob) for lp in r.logprobs]
            out[(i, r.index)] = (ids, lps, r.usage.prompt_tokens, r.usage.completion_tokens)
            seen[0] += len(r.token_ids)
            if quarter is not None and seen[0] >= total // 4:
                quarter.set()

    async with PagedServeClient(address) as client:
        await asyncio.gather(*(one(client, i, p) for i, p in enumerate(CALLS * 3)))
    return out


async def test_core_sigkill_keeps_seeded_sampling_penalties_and_logprobs_identical(model: Path,
                                                                                    tmp_path: Path) -> None:
    executor = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks", "256",
                "--num-cpu-blocks", "16"]
    with running_tiers(tmp_path, executor) as tiers:
        reference = await run_calls(tiers.public)
        assert all(len(ids) == MAX_TOKENS for ids, _, _, _ in reference.values())
        tiers.wait_idle()
        quarter = asyncio.Event()
        disturbed = asyncio.create_task(run_calls(tiers.public, quarter))
        await asyncio.wait_for(quarter.wait(), 60)
        tiers.kill_core(signal.SIGKILL)
        tiers.start_core()
        outcome = await asyncio.wait_for(disturbed, 180)
        assert outcome.keys() == reference.keys()
        for key, (ids, lps, prompt_tokens, completion) in reference.items():
            got_ids, got_lps, got_prompt, got_completion = outcome[key]
            assert got_ids == ids, key
            assert (got_prompt, got_completion) == (prompt_tokens, completion), key
            assert [t for t, _ in got_lps] == [t for t, _ in lps], key
            assert [v for _, v in got_lps] == pytest.approx([v for _, v in lps], abs=1e-3), key
        assert "resumed" in (tmp_path / "frontend-2.log").read_text()
        tiers.wait_idle()
