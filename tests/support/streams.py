"""Streams for the restart tests (#28): greedy and seeded calls, some n > 1, over a shared prefix, collected per
sequence with their finish reason, usage and text, to compare a disturbed run with an undisturbed one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.support.procs import prompts

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


@dataclass
class Sequence:
    """What a client received of one sequence."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class TokenCount:
    """An on_token callback for run_all: the tokens received so far, and `quarter` set once a quarter of `total`
    has arrived (the moment a restart test disturbs the run)."""

    total: int
    seen: int = 0
    quarter: asyncio.Event = field(default_factory=asyncio.Event)

    def __call__(self, n: int) -> None:
        self.seen += n
        if self.seen >= self.total // 4:
            self.quarter.set()


Outcome = dict[tuple[str, int], Sequence]  # by (request id, sequence index)


async def run_all(address: str, calls: list[Spec], on_token: Callable[[int], None] = lambda n: None,
                  on_response: Callable[[tuple[str, int]], None] = lambda key: None,
                  max_tokens: int = MAX_TOKENS, resume_attempts: int = 0) -> Outcome:
    out: Outcome = {}

    async def one(client: PagedServeClient, spec: Spec) -> None:
        temperature = 0.0 if spec.seed is None else 1.0
        async for r in client.generate(prompt_token_ids=spec.prompt, request_id=spec.request_id, seed=spec.seed,
                                       max_tokens=max_tokens, temperature=temperature, ignore_eos=True, n=spec.n,
                                       timeout=120):
            seq = out.setdefault((spec.request_id, r.index), Sequence())
            seq.token_ids += r.token_ids
            seq.text += r.text
            if r.finish_reason:
                seq.finish_reason, seq.prompt_tokens = r.finish_reason, r.usage.prompt_tokens
                seq.completion_tokens = r.usage.completion_tokens
            on_token(len(r.token_ids))
            on_response((spec.request_id, r.index))

    async with PagedServeClient(address, resume_attempts=resume_attempts) as client:
        await asyncio.gather(*(one(client, s) for s in calls))
    return out


def check_complete(outcome: Outcome, calls: list[Spec], max_tokens: int = MAX_TOKENS) -> None:
    for spec in calls:
        for index in range(spec.n):
            seq = outcome[(spec.request_id, index)]
            assert (len(seq.token_ids), seq.finish_reason, seq.prompt_tokens, seq.completion_tokens) == (
                max_tokens, LENGTH, len(spec.prompt), max_tokens), spec
