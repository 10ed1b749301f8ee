"""Engine core restarts under streaming load, with front-ends on their own (#28): a SIGKILLed core's open requests
resume on the restarted core as continuations, and every stream ends with the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import prompts, wait_until
from tests.support.tiers import running_tiers

LENGTH = generation_pb2.FINISH_REASON_LENGTH
EXECUTOR = ["--simulated", "--sim-step-latency-ms", "20"]
MAX_TOKENS = 48


@dataclass(frozen=True)
class Spec:
    """One Generate call: greedy or seeded, n sequences, a shared system prefix (prefix caching)."""

    request_id: str
    prompt: list[int]
    seed: int | None
    n: int


def specs(count: int) -> list[Spec]:
    prefix = list(range(100, 132))  # two blocks every prompt shares
    return [Spec(f"s{i}", prefix + p, None if i % 3 == 0 else 1000 + i, 2 if i % 4 == 1 else 1)
            for i, p in enumerate(prompts(count))]


Outcome = dict[tuple[str, int], tuple[list[int], int, int, int]]  # (id, index) -> tokens, reason, usage


async def run_all(address: str, calls: list[Spec], on_token: Callable[[int], None] = lambda n: None,
                  max_tokens: int = MAX_TOKENS) -> Outcome:
    out: Outcome = {}

    async def one(client: PagedServeClient, spec: Spec) -> None:
        temperature = 0.0 if spec.seed is None else 1.0
        async for r in client.generate(prompt_token_ids=spec.prompt, request_id=spec.request_id, seed=spec.seed,
                                       max_tokens=max_tokens, temperature=temperature, ignore_eos=True, n=spec.n,
                                       timeout=120):
            ids, reason, prompt_tokens, completion = out.get((spec.request_id, r.index), ([], 0, 0, 0))
            ids = ids + list(r.token_ids)
            if r.finish_reason:
                reason, prompt_tokens, completion = r.finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens
            out[(spec.request_id, r.index)] = (ids, reason, prompt_tokens, completion)
            on_token(len(r.token_ids))

    async with PagedServeClient(address) as client:
        await asyncio.gather(*(one(client, s) for s in calls))
    return out


def check_complete(outcome: Outcome, calls: list[Spec], max_tokens: int = MAX_TOKENS) -> None:
    for spec in calls:
        for index in range(spec.n):
            ids, reason, prompt_tokens, completion = outcome[(spec.request_id, index)]
            assert (len(ids), reason, prompt_tokens, completion) == (max_tokens, LENGTH, len(spec.prompt),
                                                                     max_tokens), spec


async def test_core_sigkill_mid_stream_resumes_every_stream_identically(tmp_path: Path) -> None:
    calls = specs(24)
    total = sum(s.n for s in calls) * MAX_TOKENS
    with running_tiers(tmp_path, EXECUTOR, frontend_args=["--engine-core-timeout", "3"]) as tiers:
        reference = await run_all(tiers.public, calls)
        check_complete(reference, calls)
        tiers.wait_idle()
        seen = [0]
        quarter = asyncio.Event()

        def count(n: int) -> None:
            seen[0] += n
            if seen[0] >= total // 4:
                quarter.set()

        disturbed = asyncio.create_task(run_all(tiers.public, calls, count))
        await asyncio.wait_for(quarter.wait(), 60)
        tiers.kill_core(signal.SIGKILL)
        assert seen[0] < total // 2, "the kill came while most tokens were still to come"
        tiers.start_core()
        outcome = await asyncio.wait_for(disturbed, 120)
        check_complete(outcome, calls)
        assert outcome == reference, "every stream: the tokens of the undisturbed run, none twice, none missing"
        tiers.wait_idle()
        assert "resumed" in (tmp_path / "frontend-2.log").read_text()


async def test_a_frontend_that_goes_silent_is_dropped_and_its_requests_freed(tmp_path: Path) -> None:
    calls = specs(6)
    with running_tiers(tmp_path, EXECUTOR, core_args=["--engine-core-timeout", "2"]) as tiers:
        frontend = tiers.frontends[0]
        streams = asyncio.create_task(run_all(tiers.public, calls, max_tokens=200))
        await asyncio.to_thread(wait_until, lambda: tiers.metrics().get("vllm:num_requests_running", 0) > 0, 30.0,
                                "requests running")
        frontend.send_signal(signal.SIGSTOP)  # alive but silent: only the heartbeat deadline can tell
        try:
            await asyncio.to_thread(tiers.wait_idle, 30.0)
            assert "silent for" in (tmp_path / "core-1.log").read_text()
        finally:
            frontend.send_signal(signal.SIGCONT)
        outcome = await asyncio.wait_for(streams, 120)  # it comes back, is told it is unknown, and resumes
        check_complete(outcome, calls, 200)
        assert outcome == await run_all(tiers.public, calls, max_tokens=200)
