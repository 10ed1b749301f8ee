"""Greedy equality with Hugging Face transformers through the whole stack: a real torch executor
process (--model DIR), a real scheduler process, and a client over gRPC.

For each test model (a Llama and a Qwen2 with qkv bias and tied embeddings) the same 16 requests
(8 greedy, 8 seeded at temperature 0.8; prompts of 1..300 tokens) run on an executor with plenty of
KV blocks, then on one with so few blocks that requests preempt each other, under a scheduler with
`--preemption-mode swap` and then one with `--preemption-mode recompute` (two rounds each, with the
order of greedy and seeded flipped, so both kinds are among the victims), each with prefix caching
on (the default: a greedy and a seeded request share their prompt's cached blocks, a second round
finds the first's, a recomputed request re-finds its own) and off. Greedy outputs must equal
transformers' `generate` token for token in every run; seeded outputs must be the same in every run.
With plenty of blocks, an n = 4 greedy request gives four sequences equal to transformers', sharing
the prompt's blocks with copy-on-write, and an n = 3 seeded one gives sequences that differ.
"""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from client.lib import PagedServeClient
from client.port_file import wait_ports
from executor_service.default_model.model import TOKENIZER_VOCAB_SIZE, make_model
from protos.pagedserve.v1 import generation_pb2
from scheduler_service.core.config import CoreConfig, PreemptionMode
from scripts.arrival_spread import Batch, make_prompts, sweep
from tests.support.procs import loopback, parse_metrics, port_file_of, start_listening, stop, wait_healthy, wait_until

transformers = pytest.importorskip("transformers")

MODELS: dict[str, dict[str, Any]] = {
    "llama": {"arch": "llama", "seed": 1},
    "qwen2": {"arch": "qwen2", "tie_word_embeddings": True, "seed": 2},
}
PROMPT_LENGTHS = (300, 150, 64, 33, 17, 16, 7, 1)  # longest first: the victims are short, so several
# 64 new tokens each (4 blocks of growth): with 24 a request lived ~50 ms, and requests arriving spread
# over that time could run without ever filling the pool (no recompute preemption in 3 rounds, once).
MAX_TOKENS = 64
BLOCK_SIZE = 16
PLENTY = ["--num-gpu-blocks", "1024", "--num-cpu-blocks", "64"]
# 16 requests need 82 blocks for their prompts and 146 by their last token; when each greedy and
# seeded pair shares its prompt's full blocks, 47 and 111. With 64 device blocks they must preempt
# each other as they grow either way: a waiting head leaves at most 20 blocks free, less than what
# the requests admitted around it grow by. Arriving in any order at random steps up to 64 apart (a whole life),
# the 16 (prompts not shared) preempted in each of 60 orders (scripts/arrival_spread.py --prompts
# 300,300,150,150,64,64,33,33,17,17,16,16,7,7,1,1 --max-tokens 64 --blocks 64 --preemption-mode recompute).
TIGHT = ["--num-gpu-blocks", "64", "--num-cpu-blocks", "128"]
TIGHT_ROUNDS = 2  # the second with seeded requests first, so both kinds are among the latest admitted
MAX_ROUNDS = 3
LENGTH = generation_pb2.FINISH_REASON_LENGTH
SWAP = "pagedserve:num_preemptions_by_mode_total{swap}"
HITS = "vllm:prefix_cache_hits_total"
NO_CACHE = ["--no-enable-prefix-caching"]
N_PROMPT = 1  # PROMPTS[1], 150 tokens: 9 full blocks and 6 tokens in a tenth
RECOMPUTE = "pagedserve:num_preemptions_by_mode_total{recompute}"


def make_prompt(length: int) -> list[int]:
    rng = random.Random(length)
    return [rng.randrange(3, TOKENIZER_VOCAB_SIZE) for _ in range(length)]


PROMPTS = [make_prompt(n) for n in PROMPT_LENGTHS]


def hf_greedy(hf: Any, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        # eos_token_id=None as a generate() argument overrides the model's generation_config, so
        # generation runs to max_new_tokens without touching the logits (min_new_tokens would mask EOS).
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_new, "transformers stopped early: EOS was not disabled"
    return tokens


@dataclass
class Run:
    greedy: list[list[int]] = field(default_factory=list)
    seeded: list[list[int]] = field(default_factory=list)
    reasons: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    rounds: int = 0
    parallel: dict[str, list[list[int]]] = field(default_factory=dict)


@dataclass
class Case:
    name: str
    reference: list[list[int]]
    runs: dict[str, Run]


async def generate(client: PagedServeClient, prompt: list[int], **sampling: Any) -> tuple[list[int], int]:
    ids: list[int] = []
    reason = 0
    async for r in client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   timeout=120, **sampling):
        ids += r.token_ids
        reason = r.finish_reason or reason
    return ids, reason


async def generate_n(client: PagedServeClient, prompt: list[int], n: int, **sampling: Any) -> list[list[int]]:
    seqs: list[list[int]] = [[] for _ in range(n)]
    async for r in client.generate(prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True, n=n,
                                   timeout=120, **sampling):
        seqs[r.index] += r.token_ids
    return seqs


async def run_parallel(address: str, run: Run) -> None:
    async with PagedServeClient(address) as client:
        greedy, seeded = await asyncio.gather(generate_n(client, PROMPTS[N_PROMPT], 4, temperature=0.0),
                                              generate_n(client, PROMPTS[N_PROMPT], 3, temperature=0.8, seed=7))
    run.parallel = {"greedy": greedy, "seeded": seeded}


async def run_batch(address: str, run: Run) -> None:
    """All 16 requests at once, greedy and seeded interleaved (the seeded first in odd rounds, so that
    both kinds are among the latest admitted, which are the preemption victims); results appended to run."""
    seeded_first = run.rounds % 2 == 1
    async with PagedServeClient(address) as client:
        calls = []
        for i, p in enumerate(PROMPTS):
            pair = [generate(client, p, temperature=0.0), generate(client, p, temperature=0.8, seed=100 + i)]
            calls += pair[::-1] if seeded_first else pair
        results = await asyncio.gather(*calls)
    greedy, seeded = (results[1::2], results[0::2]) if seeded_first else (results[0::2], results[1::2])
    run.greedy += [ids for ids, _ in greedy]
    run.seeded += [ids for ids, _ in seeded]
    run.reasons += [reason for _, reason in results]
    run.rounds += 1


def metrics(port: int) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def idle(port: int) -> bool:
    m = metrics(port)
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0 \
        and m["vllm:num_requests_swapped"] == 0


@contextmanager
def process(module: str, args: list[str], log: Path) -> Iterator[tuple[str, dict[str, int]]]:
    """The service on the ports it picked: its address and its port file's ports (metrics_port once healthy)."""
    proc, ports = start_listening(module, args, log)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        yield address, wait_ports(port_file_of(log), ("listen", "metrics_port") if "--metrics-port" in args
                                  else ("listen",), proc)
    finally:
        stop(proc)


@contextmanager
def loading(module: str, args: list[str], log: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The service started, its port bound, maybe still loading its model: its address and process."""
    proc, ports = start_listening(module, args, log)
    try:
        yield loopback(ports["listen"]), proc
    finally:
        stop(proc)


def wait_loaded(address: str, proc: subprocess.Popen[bytes]) -> str:
    wait_healthy(address, proc)
    return address


def serve(executor: str, scheduler_args: list[str], log: Path, rounds: int = 1, must_see: str | None = None,
          parallel: bool = False) -> Run:
    """Start a scheduler on executor, run the batch `rounds` times (more, up to MAX_ROUNDS, until must_see
    counted), then the n > 1 requests if parallel."""
    run = Run()
    with process("scheduler_service", ["--executor", executor, "--metrics-port", "0", *scheduler_args],
                 log) as (address, ports):
        port = ports["metrics_port"]
        while run.rounds < MAX_ROUNDS:
            asyncio.run(run_batch(address, run))
            wait_until(lambda: idle(port), what="the scheduler to go idle")
            run.metrics = metrics(port)
            if run.rounds >= rounds and (must_see is None or run.metrics.get(must_see, 0) > 0):
                break
        if parallel:
            asyncio.run(run_parallel(address, run))
            wait_until(lambda: idle(port), what="the scheduler to go idle")
            run.metrics = metrics(port)
    return run


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    name: str = request.param
    root = tmp_path_factory.mktemp(f"grpc-{name}")
    path = make_model(root / name, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      vocab_size=TOKENIZER_VOCAB_SIZE, init_std=0.2, **MODELS[name])
    device = os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")
    model = ["--model", str(path), "--device", device, "--dtype", "float32", "--block-size", str(BLOCK_SIZE)]
    runs: dict[str, Run] = {}
    with loading("executor_service", [*model, *PLENTY], root / "executor-plenty.log") as plenty, \
            loading("executor_service", [*model, *TIGHT], root / "executor-tight.log") as tight:
        # both executors load while transformers computes the reference
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        reference = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
        executor = wait_loaded(*plenty)
        runs["plenty"] = serve(executor, [], root / "scheduler-plenty.log", rounds=2, parallel=True)
        runs["plenty-nocache"] = serve(executor, NO_CACHE, root / "scheduler-plenty-nocache.log", parallel=True)
        executor = wait_loaded(*tight)
        for mode, key in (("swap", SWAP), ("recompute", RECOMPUTE)):
            for suffix, flags in (("", []), ("-nocache", NO_CACHE)):
                runs[mode + suffix] = serve(executor, ["--preemption-mode", mode, *flags],
                                            root / f"scheduler-{mode}{suffix}.log", TIGHT_ROUNDS, key)
        # The runs above use the default layout (engine core + api server process, async scheduling);
        # this one is synchronous, in one process, as before the split.
        # (one round, more only until it preempted: the comparison below is of first rounds)
        runs["sync"] = serve(executor, ["--no-async-scheduling", "--api-server-count", "0"],
                             root / "scheduler-sync.log", 1, "vllm:num_preemptions_total")
    return Case(name, reference, runs)


@pytest.mark.parametrize("cache", ["", "-nocache"])
def test_greedy_equals_transformers_with_plenty_of_blocks(case: Case, cache: str) -> None:
    run = case.runs["plenty" + cache]
    assert run.reasons == [LENGTH] * len(run.reasons)
    assert run.greedy == case.reference * run.rounds
    assert run.metrics["vllm:num_preemptions_total"] == 0
    if cache:
        assert run.metrics[HITS] == 0
    else:  # the second round found every prompt's full blocks
        assert run.metrics[HITS] >= sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS)


@pytest.mark.parametrize("cache", ["", "-nocache"])
def test_n_sequences_share_the_prompt_greedy_ones_are_identical(case: Case, cache: str) -> None:
    run = case.runs["plenty" + cache]
    assert run.parallel["greedy"] == [case.reference[N_PROMPT]] * 4
    seeded = run.parallel["seeded"]
    assert all(len(s) == MAX_TOKENS for s in seeded) and len({tuple(s) for s in seeded}) == 3


def test_the_tight_batch_preempts_however_it_arrives() -> None:
    """TIGHT's block arithmetic in the scheduler core (steps, no timing; prompts not shared, as with caching off): the
    16 requests preempt in each of 20 random orders of arrival steps up to two thirds of a request's life apart
    (24 tokens, as before 4c868a9: 7 of the 20 without a preemption)."""
    blocks = int(TIGHT[TIGHT.index("--num-gpu-blocks") + 1])
    lengths = [n for n in PROMPT_LENGTHS for _ in range(2)]
    batch = Batch(make_prompts(lengths), MAX_TOKENS, [1] * len(lengths), blocks, 128, BLOCK_SIZE,
                  CoreConfig(preemption_mode=PreemptionMode.RECOMPUTE))
    missed = [i for i, (swap, recompute) in enumerate(sweep(batch, MAX_TOKENS * 2 // 3, 20)) if swap + recompute == 0]
    assert not missed, f"no preemption in orders {missed}"


@pytest.mark.parametrize("mode", ["swap", "recompute", "swap-nocache", "recompute-nocache"])
def test_greedy_equals_transformers_under_preemption(case: Case, mode: str) -> None:
    run = case.runs[mode]
    assert run.reasons == [LENGTH] * len(run.reasons)
    assert run.greedy == case.reference * run.rounds
    m = run.metrics
    assert (m[HITS] == 0) == mode.endswith("-nocache")
    if mode.startswith("swap"):
        assert m[SWAP] > 0, f"no swap preemption in {run.rounds} rounds"
        assert m["pagedserve:swap_out_blocks_total"] > 0 and m["pagedserve:swap_in_blocks_total"] > 0
    else:
        assert m[RECOMPUTE] > 0, f"no recompute preemption in {run.rounds} rounds"
        assert m[SWAP] == 0 and m["pagedserve:swap_out_blocks_total"] == 0


def test_seeded_sampling_is_the_same_with_and_without_preemption(case: Case) -> None:
    plenty = case.runs["plenty-nocache"].seeded
    assert all(len(ids) == MAX_TOKENS for ids in plenty)
    assert plenty != case.reference, "temperature 0.8 should not reproduce greedy decoding"
    assert case.runs["plenty"].parallel["seeded"] == case.runs["plenty-nocache"].parallel["seeded"]
    for mode in ("plenty", "swap", "recompute", "swap-nocache", "recompute-nocache"):
        assert case.runs[mode].seeded == plenty * case.runs[mode].rounds


def test_async_scheduling_gives_the_tokens_of_sync_mode_under_preemption(case: Case) -> None:
    sync = case.runs["sync"]
    assert sync.reasons == [LENGTH] * len(sync.reasons)
    assert sync.metrics["vllm:num_preemptions_total"] > 0
    for mode in ("swap", "recompute"):
        run = case.runs[mode]
        assert run.greedy[:len(PROMPTS)] == sync.greedy[:len(PROMPTS)]
        assert run.seeded[:len(PROMPTS)] == sync.seeded[:len(PROMPTS)]
