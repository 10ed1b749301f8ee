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
import subprocess
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.lib import PagedServeClient
from tests.support.procs import ROOT, loopback, parse_metrics, start, start_listening, stop, wait_healthy

CORPUS = ROOT / "executor_service/default_model/data/generated_corpus.txt"
# "adaptive": false: every step drafts (the measured-cost decision would make "drafts were verified" depend on the
# box's timings; tests/core tests that decision with an injected clock).
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64, "adaptive": false}'
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


@contextmanager
def running_scheduler(tmp_path: Path, executor: str, name: str, flags: list[str]) -> Iterator[tuple[str, int]]:
    """A scheduler (no api server processes) over the executor; yields its address and metrics port."""
    proc, ports = start_listening("scheduler_service", ["--executor", executor, "--metrics-port", "0",
                                                        "--api-server-count", "0", *flags],
                                  tmp_path / f"scheduler-{name}.log", ("listen", "metrics_port"))
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        yield address, ports["metrics_port"]
    finally:
        stop(proc)


def read_metrics(port: int) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


def scheduler_run(tmp_path: Path, executor: str, name: str, flags: list[str],
                  restart: Callable[[threading.Event], None] | None = None) -> tuple[Outputs, dict[str, float]]:
    """The workload through a scheduler with flags; with restart, a thread that kills and restarts the executor
    once a quarter of the tokens have streamed."""
    with running_scheduler(tmp_path, executor, name, flags) as (address, metrics):
        kill = threading.Event() if restart is not None else None
        killer = threading.Thread(target=restart, args=(kill,)) if restart is not None else None
        if killer is not None:
            killer.start()
        outputs = asyncio.run(generate(address, kill))
        if killer is not None:
            killer.join()
        return outputs, read_metrics(metrics)


@dataclass
class Executors:
    """The executor processes of a test, one after another on one address: the first (on the port it picks), and the
    one started in its place when a run kills it (on that port)."""
    tmp_path: Path
    name: str
    args: list[str]
    address: str = ""
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, wait: bool = True) -> None:
        """Start one (in the place of the last, if any); wait: until it is healthy (else see wait_healthy)."""
        log = self.tmp_path / f"executor-{self.name}-{len(self.procs)}.log"
        if self.address:
            self.procs.append(start("executor_service", ["--listen", self.address, *self.args], log))
        else:
            proc, ports = start_listening("executor_service", self.args, log)
            self.procs.append(proc)
            self.address = loopback(ports["listen"])
        if wait:
            self.wait_healthy()

    def wait_healthy(self) -> None:
        wait_healthy(self.address, self.procs[-1])

    def restart(self, kill: threading.Event) -> None:
        """A run's killer thread: SIGKILL the executor once `kill` is set, and start another in its place."""
        assert kill.wait(120), "the run never got a quarter of its tokens out"
        stop(self.procs[-1], signal.SIGKILL)
        self.start()


@contextmanager
def running_executors(tmp_path: Path, name: str, args: list[str], wait: bool = True) -> Iterator[Executors]:
    """Executors started (wait: healthy; else maybe still loading), all stopped at the end."""
    executors = Executors(tmp_path, name, args)
    try:
        executors.start(wait)
        yield executors
    finally:
        for proc in executors.procs:
            stop(proc)


def check_speculative_runs(tmp_path: Path, executors: Executors, plain: Outputs, name: str,
                           flags: list[str]) -> list[dict[str, float]]:
    """Speculation (flags) under swap preemption with async scheduling and an executor SIGKILL mid-run, then under
    recompute preemption with synchronous scheduling: each run gives every output of the plain run, verifies
    drafts and preempts. Returns the runs' metrics."""
    runs = [(f"{name}-swap-async-sigkill", ["--preemption-mode", "swap"], executors.restart),
            (f"{name}-recompute-sync", ["--preemption-mode", "recompute", "--no-async-scheduling"], None)]
    found = []
    for run_name, mode, killer in runs:
        outputs, m = scheduler_run(tmp_path, executors.address, run_name, [*flags, *mode], killer)
        for key, expected in plain.items():
            assert outputs[key] == expected, f"{run_name}: {key}"
        assert m["vllm:spec_decode_num_drafts_total"] > 0, run_name
        assert m.get("vllm:num_preemptions_total", 0.0) > 0, f"{run_name}: the small KV cache made requests preempt"
        found.append(m)
    assert len(executors.procs) == 2, "the executor was killed and restarted mid-run"
    return found


def test_speculation_keeps_every_output(tmp_path: Path) -> None:
    with running_executors(tmp_path, "ngram", EXECUTOR_ARGS) as executors:
        plain, _ = scheduler_run(tmp_path, executors.address, "plain", ["--preemption-mode", "swap"])
        assert len(plain) == len(workload()) + 1
        assert plain["stop.0"][2] != plain["copy0.0"][2], "the stop string ended its request early"
        assert plain["n2.0"] == plain["n2.1"], "greedy n = 2 gives two equal sequences"
        for m in check_speculative_runs(tmp_path, executors, plain, "spec", ["--speculative-config", SPEC]):
            assert 0 < m["vllm:spec_decode_num_accepted_tokens_total"] <= m["vllm:spec_decode_num_draft_tokens_total"]


DRAFT_MODEL = ROOT / "executor_service/default_model/data/default-model-v2"
# Fewer blocks than EXECUTOR_ARGS: a drafted step never preempts (drafts fall back to a plain decode when the
# pool is short), so only plain growth does. 16 blocks make it certain in any order: the n2 request's prompt (171
# tokens) is 10 full blocks its two sequences share, and each grows to 4 blocks of its own past them (211 tokens):
# 18 > 16. Its sibling joins the queue's front once the prompt is computed, so both run together unless others hold
# the pool, and those (8 or 11 prompt blocks beside n2's 11) outgrow it themselves.
DRAFT_EXECUTOR_ARGS = ["--num-gpu-blocks", "16", "--num-cpu-blocks", "64", "--block-size", "16"]
DRAFT_SPEC = ('{"method": "draft_model", "num_speculative_tokens": 3, "disable_by_batch_size": 64, "adaptive": false, '
              '"model": "' + str(DRAFT_MODEL) + '"}')


def test_draft_model_speculation_keeps_every_output(tmp_path: Path) -> None:
    """#31, method draft_model with the default model as its own draft: an executor without --draft-model is sent
    plain steps (and the scheduler says why); one with it gives every output of the plain run under swap
    preemption with async scheduling and an executor SIGKILL, and under recompute preemption; every greedy draft
    is accepted (the draft is the model), so acceptance is 1.0 on a greedy-only run."""
    args = [*DRAFT_EXECUTOR_ARGS, "--draft-model", str(DRAFT_MODEL)]
    with running_executors(tmp_path, "draft", args, wait=False) as executors:  # it loads while the plain runs go
        with running_executors(tmp_path, "plain", DRAFT_EXECUTOR_ARGS) as first:
            plain, _ = scheduler_run(tmp_path, first.address, "plain", ["--preemption-mode", "swap"])
            refused, m = scheduler_run(tmp_path, first.address, "no-capability", ["--speculative-config", DRAFT_SPEC])
            assert refused == plain and m.get("vllm:spec_decode_num_drafts_total", 0.0) == 0
            log = (tmp_path / "scheduler-no-capability.log").read_text()
            assert "needs an executor with a draft model" in log and "--draft-model" in log
        executors.wait_healthy()
        chunks = ["--speculative-config", DRAFT_SPEC, "--max-num-batched-tokens", "32"]  # more requests in flight
        check_speculative_runs(tmp_path, executors, plain, "draft", chunks)
        greedy = greedy_acceptance(tmp_path, executors.address)
        assert greedy["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert greedy["vllm:spec_decode_num_accepted_tokens_total"] == greedy["vllm:spec_decode_num_draft_tokens_total"]


def greedy_acceptance(tmp_path: Path, executor: str) -> dict[str, float]:
    """The spec-decode metrics of greedy requests only, through a scheduler with the draft model."""
    async def generate_greedy(address: str) -> None:
        async with PagedServeClient(address) as client:
            for prompt in copy_prompts(3):
                async for r in client.generate(prompt=prompt, max_tokens=24, temperature=0.0, ignore_eos=True):
                    assert not r.error, r.error

    with running_scheduler(tmp_path, executor, "greedy", ["--speculative-config", DRAFT_SPEC]) as (address, metrics):
        asyncio.run(generate_greedy(address))
        return read_metrics(metrics)
