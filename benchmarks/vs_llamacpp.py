"""pagedserve against llama.cpp's llama-server on the CPU, both over OpenAI /v1/completions streaming (#29).

    python -m benchmarks.vs_llamacpp [--threads 1,2] [--slots 16,32,64,128] [--num-requests 128] [--dedicated]
        [--executor-args ...] [--scheduler-args ...] [--variant 'LABEL=EXECUTOR FLAGS' ...] [--rounds N] [--no-build]
        [--baseline-tree DIR] [--scheduler-variant 'LABEL=SCHEDULER FLAGS' ...]

Finds or builds llama-server (benchmarks/llamacpp_build.py: the llama-cpp-python sdist's vendor/llama.cpp, cached
under ~/.cache/pagedserve/llama.cpp) and converts the benchmark model (benchmarks/vs_transformers.py's 32M Llama,
float32 safetensors) to GGUF f32 with llama.cpp's own converter. Then, per thread count: pagedserve (executor with
--cpu-threads N, scheduler with --http-listen) and llama-server (-t N -tb N) at each slot count, one at a time, each
sent the same ShareGPT-like requests (lognormal prompt and output lengths, the prompts as token ids, ignore_eos, all at
once) after a warm-up of 8; useful output tok/s from the streams' usage, and the CPU seconds per 1,000 output
tokens of each server process (executor, engine core, api servers; llama-server) and of this client. --dedicated adds
a pagedserve run with the settings once documented for a machine that runs nothing but the server, and each --variant
one with those executor flags, each --scheduler-variant one with those scheduler flags; --baseline-tree DIR one
whose executor and scheduler run another tree's code (from DIR, with PYTHONPATH=DIR; e.g. a `git archive` of main:
two trees' whole stacks in one run); --rounds N repeats every run N
times, interleaved, and reports each one's mean.
Greedy equality first: the first --check-requests prompts, 16 tokens each, at temperature 0 on llama.cpp and on each
pagedserve configuration with its own executor flags (texts compared, counted by label). Prints one
JSON line per run and a summary with pagedserve / llama.cpp's best slot count at each thread count. Skips cleanly
(exit 0, a JSON line saying why) where llama-server cannot be found or built, or the model cannot be converted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.llamacpp_build import convert, find_server
from benchmarks.vs_transformers import DEFAULT_CACHE, MODEL_SPEC, ensure_model
from client.bench.datasets import BenchRequest, SyntheticConfig, synthetic_requests
from client.bench.openai_backend import OpenAIBenchClient
from client.bench.record import machine
from client.bench.runner import RunConfig, run_benchmark
from client.bench.stats import SLO, compute_metrics
from client.local import ROOT, child_pids, free_port, service

CTX_PER_SLOT = 640  # the longest request (256 + 256 tokens) and llama.cpp's BOS, with room


def workload(args: argparse.Namespace) -> list[BenchRequest]:
    cfg = SyntheticConfig(num_prompts=args.num_requests, input_mean=64.0, output_mean=64.0, input_max=256,
                          output_max=256, sigma=1.0, vocab_size=MODEL_SPEC["vocab_size"], seed=args.seed)
    return synthetic_requests(cfg)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of every thread of process pid so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each named process, and of this one (the benchmark's client) as "client"."""
    return {**{name: cpu_seconds(pid) for name, pid in pids.items()}, "client": cpu_seconds(os.getpid())}


def cpu_per_1k(before: dict[str, float], after: dict[str, float], tokens: int) -> dict[str, float]:
    """CPU seconds per 1,000 useful output tokens, per process, between two snapshots."""
    return {name: round((after[name] - before[name]) * 1000 / max(tokens, 1), 3) for name in before}


async def serve_run(url: str, reqs: list[BenchRequest], pids: dict[str, int]) -> dict[str, Any]:
    """Warm-up, then every request at once: useful output tok/s, TTFT and TPOT means, and the CPU seconds each of
    the server's processes (and the client) spent per 1,000 output tokens in the timed run."""
    cfg = RunConfig(ignore_eos=True, show_progress=False, timeout=1800)
    async with OpenAIBenchClient(url) as client:
        if not await client.check():
            raise RuntimeError(f"{url} is not answering /v1/models")
        await run_benchmark(client, reqs[:8], cfg)
        before = cpu_snapshot(pids)
        result = await run_benchmark(client, reqs, cfg)
        after = cpu_snapshot(pids)
    m = compute_metrics(result.traces, result.duration, [50.0], SLO())
    tokens = sum(t.output_len for t in result.traces if t.success)
    return {"completed": m.completed, "resent": sum(t.resent for t in result.traces),
            "output_tok_s": round(m.output_throughput, 1),
            "ttft_ms": round(m.ttft.mean, 1), "tpot_ms": round(m.tpot.mean, 2), "seconds": round(result.duration, 2),
            "cpu_s_per_1k_tokens": cpu_per_1k(before, after, tokens)}


async def greedy_texts(url: str, reqs: list[BenchRequest]) -> list[str]:
    cfg = RunConfig(ignore_eos=True, show_progress=False, timeout=600, max_concurrency=1)
    async with OpenAIBenchClient(url) as client:
        if not await client.check():
            raise RuntimeError(f"{url} is not answering /v1/models")
        result = await run_benchmark(client, [replace(r, max_tokens=16) for r in reqs], cfg)
    return [t.text for t in sorted(result.traces, key=lambda t: t.start)]


@contextlib.contextmanager
def pagedserve(model: Path, threads: int, extra: tuple[str, ...] = (), scheduler_extra: tuple[str, ...] = (),
               tree: Path = ROOT) -> Iterator[tuple[str, dict[str, int]]]:
    """The executor and the scheduler with an HTTP front-end, both run from `tree`'s code (this repository's by
    default); yields the front-end's URL and the processes by role."""
    http_port = free_port()
    executor_args = ["--device", "cpu", "--model", str(model), "--num-gpu-blocks", "4096",
                     "--cpu-threads", str(threads), *extra]
    env = {"PYTHONPATH": str(tree)} if tree != ROOT else None
    with service("executor_service", executor_args, env=env, name="executor", cwd=tree) as executor, \
            service("scheduler_service", ["--executor", executor.address, "--metrics-port", "-1",
                                          "--http-listen", f"127.0.0.1:{http_port}", *scheduler_extra],
                    env=env, name="scheduler", cwd=tree) as core:
        if not wait_calibrated(executor.log):
            print(json.dumps({"warning": "the executor's packing was not final in time; timing anyway"}), flush=True)
        yield f"http://127.0.0.1:{http_port}", processes(executor.proc.pid, core.proc.pid)


def processes(executor: int, core: int) -> dict[str, int]:
    """pagedserve's processes by role: the executor, the engine core and its api servers (any other children of
    the core, the resource tracker, the grammar compiler, sit idle in this workload)."""
    servers = [pid for pid, kind in child_pids(core).items() if kind == "api server"]
    return {"executor": executor, "engine core": core,
            **{f"api server {i}": pid for i, pid in enumerate(servers)}}


def wait_calibrated(log: Path, timeout: float = 600.0) -> bool:
    """Until the executor's packing choice is final: from the start-up cache, or measured after ready (its log says
    which: "packing measured", or the background packing's "(measured; kept for the next start)" or, where the
    cache could not keep it, "(measured; not kept: ...)"), so that the
    timed runs do not share the cores with the measurement or see its swap. False if it was not in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.is_file() else ""
        packed = "linear weights packed" in text
        measured = "packing measured" in text or "(measured; kept for the next start)" in text \
            or "(measured; not kept: " in text
        populating = "pages are faulted in while" in text and "faulted in after ready" not in text
        if (measured or (packed and "measuring in the background" not in text)) and not populating:
            return True
        time.sleep(0.5)  # polling another process's log; not a test
    return False


@contextlib.contextmanager
def llama_server(server: Path, gguf: Path, threads: int, slots: int,
                 log_dir: Path) -> Iterator[tuple[str, dict[str, int]]]:
    port = free_port()
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-np", str(slots), "-c", str(slots * CTX_PER_SLOT), "--no-webui"]
    with open(log_dir / f"llama-server-{threads}t-{slots}.log", "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_health(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}", {"llama-server": proc.pid}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 300.0) -> None:
    """Poll llama-server's /health until it answers 200 (the model loaded) or the process exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(0.2)  # polling a process we do not control; not a test
    raise RuntimeError("llama-server not healthy in time")


def check_greedy(model: Path, server: Path, gguf: Path, reqs: list[BenchRequest], log_dir: Path,
                 configs: Configs) -> dict[str, Any]:
    """Greedy texts of each pagedserve configuration whose executor flags differ (the defaults, a variant such as
    --kv-cache-dtype float16), at one thread, against llama.cpp's: how many are equal, by label."""
    with llama_server(server, gguf, 1, 1, log_dir) as (url, _):
        theirs = asyncio.run(greedy_texts(url, reqs))
    equal: dict[str, int] = {}
    checked: set[tuple[tuple[str, ...], Path]] = set()
    for label, config in configs.items():
        if (config.executor, config.tree) in checked:
            continue
        checked.add((config.executor, config.tree))
        with pagedserve(model, 1, config.executor, tree=config.tree) as (url, _):
            ours = asyncio.run(greedy_texts(url, reqs))
        equal[label] = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return {"prompts": len(reqs), "equal": equal}


DEDICATED = (("--cpu-omp-wait-policy", "active"), ("--cpu-nice", "10"))  # once documented for a server-only box


@dataclass(frozen=True)
class Config:
    """One pagedserve configuration: executor and scheduler flags, and the tree whose code both run."""
    executor: tuple[str, ...]
    scheduler: tuple[str, ...]
    tree: Path = ROOT


Configs = dict[str, Config]  # by label


def pagedserve_configs(extra: tuple[str, ...], scheduler_extra: tuple[str, ...], dedicated: bool,
                       variants: tuple[str, ...] | list[str] = (), baseline_tree: Path | None = None,
                       scheduler_variants: tuple[str, ...] | list[str] = ()) -> Configs:
    """The pagedserve runs at each thread count, by label: the defaults (plus any extra flags); with --dedicated
    also the documented settings for a machine that runs nothing but the server; each --variant
    'LABEL=EXECUTOR FLAGS' and --scheduler-variant 'LABEL=SCHEDULER FLAGS' (the defaults' flags plus those); and
    with --baseline-tree the defaults with the whole stack (executor and scheduler) from that tree."""
    configs = {"pagedserve": Config(extra, scheduler_extra)}
    if baseline_tree is not None:
        for package in ("executor_service", "scheduler_service"):
            if not (baseline_tree / package / "__main__.py").is_file():
                raise SystemExit(f"--baseline-tree {baseline_tree} has no {package}/__main__.py")
        configs["pagedserve baseline"] = Config(extra, scheduler_extra, baseline_tree.resolve())
    if dedicated:
        configs["pagedserve dedicated"] = Config((*extra, *DEDICATED[0]), (*scheduler_extra, *DEDICATED[1]))
    for variant in variants:
        label, flags = parse_variant(variant, "--variant", "EXECUTOR")
        configs[f"pagedserve {label}"] = Config((*extra, *flags), scheduler_extra)
    for variant in scheduler_variants:
        label, flags = parse_variant(variant, "--scheduler-variant", "SCHEDULER")
        configs[f"pagedserve {label}"] = Config(extra, (*scheduler_extra, *flags))
    return configs


def parse_variant(variant: str, option: str, side: str) -> tuple[str, tuple[str, ...]]:
    """'LABEL=FLAGS' -> (label, flags); exits naming the option on anything else."""
    label, sep, flags = variant.partition("=")
    if not sep or not label.strip():
        raise SystemExit(f"{option} wants LABEL={side} FLAGS, got {variant!r}")
    return label.strip(), tuple(flags.split())


def one_round(model: Path, server: Path, gguf: Path, threads: int, slots: list[int], reqs: list[BenchRequest],
              log_dir: Path, configs: Configs, round_no: int) -> dict[str, dict[str, Any]]:
    """Every pagedserve configuration (in an order rotated by the round number, so that none is always the one that
    follows another), then llama-server at each slot count, one after another: their runs."""
    runs: dict[str, dict[str, Any]] = {}
    labels = list(configs)
    for label in labels[round_no % len(labels):] + labels[:round_no % len(labels)]:
        config = configs[label]
        with pagedserve(model, threads, config.executor, config.scheduler, config.tree) as (url, pids):
            runs[label] = asyncio.run(serve_run(url, reqs, pids))
        print(json.dumps({"threads": threads, "round": round_no, "server": label, **runs[label]}), flush=True)
    for n in slots:
        with llama_server(server, gguf, threads, n, log_dir) as (url, pids):
            runs[f"llama.cpp np={n}"] = asyncio.run(serve_run(url, reqs, pids))
        print(json.dumps({"threads": threads, "round": round_no, "server": f"llama.cpp np={n}",
                          **runs[f"llama.cpp np={n}"]}), flush=True)
    return runs


def one_thread_count(model: Path, server: Path, gguf: Path, threads: int, slots: list[int],
                     reqs: list[BenchRequest], log_dir: Path,
                     configs: Configs, rounds: int = 1) -> dict[str, object]:
    """`rounds` interleaved rounds of every run; each run's tok/s by round and their mean, and the ratio of each
    pagedserve configuration's mean to llama.cpp's best mean."""
    by_round = [one_round(model, server, gguf, threads, slots, reqs, log_dir, configs, r) for r in range(rounds)]
    mean = {k: round(sum(r[k]["output_tok_s"] for r in by_round) / rounds, 1) for k in by_round[0]}
    row: dict[str, object] = {"threads": threads, "rounds": rounds, **{f"{k}_tok_s": mean[k] for k in configs}}
    if rounds > 1:
        row["by_round"] = {k: [r[k]["output_tok_s"] for r in by_round] for k in by_round[0]}
    if slots:
        best = max((k for k in mean if k not in configs), key=lambda k: mean[k])
        row.update({"llamacpp_best": best, "llamacpp_tok_s": mean[best]})
        row.update({f"ratio {k}": round(mean[k] / max(mean[best], 1e-9), 2) for k in configs})
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=DEFAULT_CACHE / "bench-llama-32m")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts, both servers")
    p.add_argument("--slots", default="16,32,64,128", help="llama-server -np values to sweep ('': pagedserve alone)")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--check-requests", type=int, default=8, help="prompts for the greedy check (0: skip it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--executor-args", default="", help="extra executor flags, space-separated")
    p.add_argument("--scheduler-args", default="", help="extra scheduler flags, space-separated")
    p.add_argument("--dedicated", action="store_true", help="also run pagedserve with the settings once documented "
                   "for a machine that runs nothing but the server (executor --cpu-omp-wait-policy active, scheduler "
                   "--cpu-nice 10; since the kernels' own pool, 30%% slower: docs/operations.md)")
    p.add_argument("--variant", action="append", default=[], help="LABEL=EXECUTOR FLAGS: one more pagedserve run "
                   "with these executor flags added (repeatable), e.g. 'spin=--cpu-omp-spin-count 50000'")
    p.add_argument("--scheduler-variant", action="append", default=[], help="LABEL=SCHEDULER FLAGS: one more "
                   "pagedserve run with these scheduler flags added (repeatable), e.g. 'core1=--cpu-cores 1'")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every run at each thread count "
                   "(tok/s by round and the mean)")
    p.add_argument("--baseline-tree", type=Path, default=None, help="also run pagedserve with the executor's and "
                   "the scheduler's code from this tree (PYTHONPATH), e.g. `git archive main | tar -x -C DIR`: two "
                   "trees in one run")
    p.add_argument("--no-build", action="store_true", help="skip (do not build) when no llama-server is found")
    args = p.parse_args(argv)
    server, how = find_server(build=not args.no_build)
    if server is None:
        print(json.dumps({"bench": "vs_llamacpp", "skipped": how}))
        return
    model = ensure_model(args.model_dir)
    gguf, converted = convert(model, server)
    if gguf is None:
        print(json.dumps({"bench": "vs_llamacpp", "skipped": converted}))
        return
    reqs = workload(args)
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    with tempfile.TemporaryDirectory(prefix="vs-llamacpp-") as tmp:
        log_dir = Path(tmp)
        configs = pagedserve_configs(tuple(args.executor_args.split()), tuple(args.scheduler_args.split()),
                                     args.dedicated, args.variant, args.baseline_tree,
                                     args.scheduler_variant)
        greedy = check_greedy(model, server, gguf, reqs[:args.check_requests], log_dir, configs) \
            if args.check_requests else {}
        print(json.dumps({"greedy_check": greedy}), flush=True)
        rows = [one_thread_count(model, server, gguf, int(t), slots, reqs, log_dir, configs, max(1, args.rounds))
                for t in args.threads.split(",")]
    print(json.dumps({"bench": "vs_llamacpp", "server": str(server), "found": how, "gguf": converted,
                      "requests": len(reqs), "greedy": greedy, "rows": rows, "machine": machine()}))


if __name__ == "__main__":
    main()
