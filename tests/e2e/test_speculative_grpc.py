"""Speculative decoding through the whole stack: a real torch executor process (the embedded default model,
with few KV blocks so that requests preempt each other), schedulers with and without --speculative-config
against it in turn, and clients over gRPC.

The same workload -- greedy prompts whose answers copy spans of the prompt (so n-gram drafts are accepted),
an n = 2 greedy request, a request ended by a stop string and two seeded sampled requests, all at once --
must give the same tokens, text and finish reasons with speculation off; with it on (async scheduling, swap
preemption), while the executor is SIGKILLed and restarted mid-run; and with it on under recompute
preemption and synchronous scheduling. The speculative runs must have verified drafts and accepted some.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import urllib.request
from pathlib import Path
from typing import Any

from client.lib import PagedServeClient
from tests.support.procs import ROOT, free_port, parse_metrics, start, stop, wait_healthy

CORPUS = ROOT / "executor_service/default_model/data/generated_corpus.txt"
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}'
MAX_TOKENS = 40
# 24 blocks of 16: prompts take 8 blocks (three of them) or 11 (six) and each grows by 3 over MAX_TOKENS. Two
# 11-block prompts fit at once, so FCFS admission runs one beside another request, and any such pair (but one
# with the stop request, which ends early) outgrows the pool: a preemption whatever order the requests arrive
# and finish in. (With 40 blocks, some orders never preempted; CI met one.)
EXECUTOR_ARGS = ["--num-gpu-blocks", "24", "--num-cpu-blocks", "64", "--block-size", "16"]
Outputs = dict[str, tuple[tuple[int, ...], str, int]]


def copy_prompts(count: int) -> list[str]:
    text = CORPUS.read_text(encoding="utf-8")
    found = [p.strip() for p in text.split("\n\n") if 300 <= len(p.strip()) <= 600 and "User:" not in p]
    return [p + "\n\n" + " ".join(p.split(" ")[:len(p.split(" ")) // 3]) for p in found[:count]]


def workload() -> list[tuple[str, dict[str, Any]]]:
    prompts = copy_prompts(7)
    greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
    work = [(f"copy{i}", {"prompt": p, **greedy}) for i, p in enumerate(prompts[:5])]
    work.append(("n2", {"prompt": prompts[5], **greedy, "n": 2}))
    work.append(("stop", {"prompt": prompts[6], **greedy, "stop": [" the "]}))
    for seed in (3, 4):
        work.append((f"seeded{seed}", {"prompt": prompts[seed], "max_tokens": MAX_TOKENS, "temperature": 0.8,
                                       "seed": seed, "ignore_eos": True}))
    return work


async def generate(address: str, kill: threading.Event | None = None) -> Outputs:
    """Every request of the workload at once; each sequence's (token ids, text, finish reason). `kill` is set
    once a quarter of the tokens have streamed."""
    target = len(workload()) * MAX_TOKENS // 4
    streamed = [0]

    async def one(client: PagedServeClient, name: str, kwargs: dict[str, Any]) -> Outputs:
        seqs: dict[int, tuple[list[int], str, int]] = {}
        async for r in client.generate(**kwargs):
            ids, text, reason = seqs.get(r.index, ([], "", 0))
            seqs[r.index] = (ids + list(r.token_ids), text + r.text, r.finish_reason or reason)
            assert not r.error, r.error
            streamed[0] += len(r.token_ids)
            if kill is not None and streamed[0] >= target:
                kill.set()
        return {f"{name}.{i}": (tuple(ids), text, reason) for i, (ids, text, reason) in seqs.items()}

    async with PagedServeClient(address) as client:
        results = await asyncio.gather(*(one(client, name, kwargs) for name, kwargs in workload()))
    return {k: v for r in results for k, v in r.items()}


def scheduler_run(tmp_path: Path, executor: str, name: str, flags: list[str],
                  restart: Any = None) -> tuple[Outputs, dict[str, float]]:
    port, metrics = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    proc = start("scheduler_service", ["--listen", address, "--executor", executor, "--metrics-port", str(metrics),
                                       "--api-server-count", "0", *flags], tmp_path / f"scheduler-{name}.log")
    try:
        wait_healthy(address, proc)
        kill = threading.Event() if restart is not None else None
        killer = threading.Thread(target=restart, args=(kill,)) if restart is not None else None
        if killer is not None:
            killer.start()
        outputs = asyncio.run(generate(address, kill))
        if killer is not None:
            killer.join()
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        return outputs, parse_metrics(text)
    finally:
        stop(proc)


def test_speculation_keeps_every_output(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"
    args = ["--listen", address, *EXECUTOR_ARGS]
    executors = [start("executor_service", args, tmp_path / "executor.log")]

    def restart(kill: threading.Event) -> None:
        assert kill.wait(120), "the run never got a quarter of its tokens out"
        stop(executors[-1], signal.SIGKILL)
        executors.append(start("executor_service", args, tmp_path / "executor-2.log"))
        wait_healthy(address, executors[-1])

    try:
        wait_healthy(address, executors[0])
        plain, _ = scheduler_run(tmp_path, address, "plain", ["--preemption-mode", "swap"])
        assert len(plain) == len(workload()) + 1
        assert plain["stop.0"][2] != plain["copy0.0"][2], "the stop string ended its request early"
        assert plain["n2.0"] == plain["n2.1"], "greedy n = 2 gives two equal sequences"
        runs = {
            "spec-swap-async-sigkill": (["--speculative-config", SPEC, "--preemption-mode", "swap"], restart),
            "spec-recompute-sync": (["--speculative-config", SPEC, "--preemption-mode", "recompute",
                                     "--no-async-scheduling"], None),
        }
        for name, (flags, killer) in runs.items():
            outputs, m = scheduler_run(tmp_path, address, name, flags, killer)
            for key, expected in plain.items():
                assert outputs[key] == expected, f"{name}: {key}"
            assert m["vllm:spec_decode_num_drafts_total"] > 0, name
            assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]
            assert m.get("vllm:num_preemptions_total", 0.0) > 0, f"{name}: the small KV cache made requests preempt"
        assert len(executors) == 2, "the executor was killed and restarted mid-run"
    finally:
        for proc in executors:
            stop(proc)


DRAFT_MODEL = ROOT / "executor_service/default_model/data/default-model-v2"
# Fewer blocks than EXECUTOR_ARGS: a drafted step never preempts (drafts fall back to a plain decode when the
# pool is short), so only plain growth does, and 16 blocks (one of the longest requests and a little) make it.
DRAFT_EXECUTOR_ARGS = ["--num-gpu-blocks", "16", "--num-cpu-blocks", "64", "--block-size", "16"]
DRAFT_SPEC = ('{"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 64, "model": "'
              + str(DRAFT_MODEL) + '"}')


def test_draft_model_speculation_keeps_every_output(tmp_path: Path) -> None:
    """#31, method draft_model with the default model as its own draft: an executor without --draft-model is sent
    plain steps (and the scheduler says why); one with it gives every output of the plain run under swap
    preemption with async scheduling and an executor SIGKILL, and under recompute preemption; every greedy draft
    is accepted (the draft is the model), so acceptance is 1.0 on a greedy-only run."""
    address = f"127.0.0.1:{free_port()}"
    plain_exec = start("executor_service", ["--listen", address, *DRAFT_EXECUTOR_ARGS],
                       tmp_path / "executor-plain.log")
    try:
        wait_healthy(address, plain_exec)
        plain, _ = scheduler_run(tmp_path, address, "plain", ["--preemption-mode", "swap"])
        refused, m = scheduler_run(tmp_path, address, "no-capability", ["--speculative-config", DRAFT_SPEC])
        assert refused == plain and m.get("vllm:spec_decode_num_drafts_total", 0.0) == 0
        log = (tmp_path / "scheduler-no-capability.log").read_text()
        assert "needs an executor with a draft model" in log and "--draft-model" in log
    finally:
        stop(plain_exec)
    args = ["--listen", address, *DRAFT_EXECUTOR_ARGS, "--draft-model", str(DRAFT_MODEL)]
    executors = [start("executor_service", args, tmp_path / "executor.log")]

    def restart(kill: threading.Event) -> None:
        assert kill.wait(120), "the run never got a quarter of its tokens out"
        stop(executors[-1], signal.SIGKILL)
        executors.append(start("executor_service", args, tmp_path / "executor-2.log"))
        wait_healthy(address, executors[-1])

    try:
        wait_healthy(address, executors[0])
        chunks = ["--speculative-config", DRAFT_SPEC, "--max-num-batched-tokens", "32"]  # more requests in flight
        runs = {
            "draft-swap-async-sigkill": ([*chunks, "--preemption-mode", "swap"], restart),
            "draft-recompute-sync": ([*chunks, "--preemption-mode", "recompute", "--no-async-scheduling"], None),
        }
        for name, (flags, killer) in runs.items():
            outputs, m = scheduler_run(tmp_path, address, name, flags, killer)
            for key, expected in plain.items():
                assert outputs[key] == expected, f"{name}: {key}"
            assert m["vllm:spec_decode_num_drafts_total"] > 0, name
            assert m.get("vllm:num_preemptions_total", 0.0) > 0, f"{name}: the small KV cache made requests preempt"
        assert len(executors) == 2, "the executor was killed and restarted mid-run"
        greedy = asyncio.run(greedy_acceptance(tmp_path, address))
        assert greedy["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert greedy["vllm:spec_decode_num_accepted_tokens_total"] == greedy["vllm:spec_decode_num_draft_tokens_total"]
    finally:
        for proc in executors:
            stop(proc)


async def greedy_acceptance(tmp_path: Path, executor: str) -> dict[str, float]:
    """The spec-decode metrics of greedy requests only, through a scheduler with the draft model."""
    port, metrics = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    proc = start("scheduler_service", ["--listen", address, "--executor", executor, "--metrics-port", str(metrics),
                                       "--api-server-count", "0", "--speculative-config", DRAFT_SPEC],
                 tmp_path / "scheduler-greedy.log")
    try:
        await asyncio.to_thread(wait_healthy, address, proc)
        async with PagedServeClient(address) as client:
            for prompt in copy_prompts(3):
                async for r in client.generate(prompt=prompt, max_tokens=24, temperature=0.0, ignore_eos=True):
                    assert not r.error, r.error
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode()
        return parse_metrics(text)
    finally:
        stop(proc)
