"""Data parallel: delivered tokens/s with 1, 2 and 4 simulated executors behind one scheduler, measured in one run.

    python benchmarks/pool.py [--executors 1,2,4] [--streams 512] [--step-ms 20] [--max-num-seqs 128]
                              [--output-len 100] [--mode engine|service|both] [--json-out FILE]

Each executor is `python -m executor_service --simulated --sim-step-latency-ms 20`: every step takes 20 ms
whatever its batch, and --max-num-seqs caps each executor's batch (it stands for one replica's KV capacity),
so K executors can deliver at most K * max_num_seqs tokens per 20 ms. 512 streams of --output-len tokens
(16-token prompts, ignore_eos) all arrive at once.

Mode `engine` (the pool itself): this process runs the scheduler service's real ExecutorPool (one ExecutorLoop, step
loop and Scheduler per executor, each its own Execute stream over gRPC), and deltas go to a counting queue
instead of client streams. It reports delivered tokens/s, each executor's busy fraction (steps * step time /
wall) this process's CPU use (cpu seconds / wall: near 1.0 means the scheduler process is the limit) and each
executor process's (includes its start-up and idle polling around the run, so an upper bound).

Mode `service` (the whole product): both services as processes and 512 streaming gRPC clients in this process.
The scheduler process does per-client work on its one event loop (accept, detokenize, one response per
token per stream): that is issue #12's subject, and on a small shared machine it, not the executors, sets
the ceiling. The scheduler's own CPU use is read from /proc to show it, and the clients' (this process) beside it:
on two shared cores, scheduler + clients + executors compete for the same CPUs.

Figures are ratios to the 1-executor run of the same mode in the same invocation. scheduler_cpu_us_per_token
(scheduler CPU seconds per delivered token) is the load-independent figure: 1e6 / it is the most tokens/s one
core could deliver through that mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvloop

from client.bench.record import emit, machine
from client.lib import PagedServeClient
from client.local import free_port, start, stop, wait_healthy, wait_until
from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.engine.pool import ExecutorPool, PoolConfig

PROMPT_LEN = 16


@contextlib.contextmanager
def executors(count: int, step_ms: float, log_dir: Path) -> Iterator[list[tuple[str, int]]]:
    port = free_port()
    procs = []
    try:
        for n in range(1, count + 1):
            address = f"127.0.0.{n}:{port}"
            procs.append(start("executor_service", [
                "--listen", address, "--simulated", "--sim-step-latency-ms", str(step_ms),
                "--num-gpu-blocks", "100000", "--num-cpu-blocks", "16", "--max-num-seqs", "100000",
                "--max-num-batched-tokens", "1000000"], log_dir / f"executor-{n}.log"))
            wait_healthy(address, procs[-1])
        yield [(f"127.0.0.{n}:{port}", proc.pid) for n, proc in enumerate(procs, start=1)]
    finally:
        for proc in procs:
            stop(proc)


def prompt(i: int) -> list[int]:
    return [3 + (i * 31 + j) % 1000 for j in range(PROMPT_LEN)]


async def engine_run(addresses: list[str], streams: int, output_len: int, max_num_seqs: int) -> dict[str, Any]:
    core = CoreConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(2048, streams * PROMPT_LEN))
    pool = ExecutorPool(PoolConfig(addresses), core, max_queue_len=100_000)  # plain Engines
    await pool.start()
    await asyncio.wait_for(_all_serving(pool, len(addresses)), 30)
    queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
    sampling = SamplingOptions(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(streams):
        pool.add(Request(f"r{i}", prompt(i), sampling, time.monotonic()), queue)
    tokens = finished = 0
    while finished < streams:
        delta = await queue.get()
        tokens += len(delta.new_token_ids)
        finished += delta.finish_reason is not None
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    steps = [_steps(pool, a) for a in addresses]
    await pool.stop()
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "scheduler_cpu": cpu / wall,
            "steps_per_executor": steps}


async def _all_serving(pool: ExecutorPool, count: int) -> None:
    while len(pool.serving()) < count:
        await asyncio.sleep(0.05)


def _steps(pool: ExecutorPool, address: str) -> float:
    m = pool.metrics
    labels = {"model_name": m.model_name, "executor": address} if m is not None else {}
    value = m.registry.get_sample_value("pagedserve:executor_step_seconds_count", labels) if m else None
    return value or 0.0


def serving_count(metrics_port: int) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(line.startswith("pagedserve:executor_serving{") and line.endswith(" 1.0") for line in text.splitlines())


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def service_run(addresses: list[str], streams: int, output_len: int, max_num_seqs: int,
                      log_dir: Path) -> dict[str, Any]:
    listen = f"127.0.0.1:{free_port()}"
    metrics_port = free_port()
    args = ["--listen", listen, "--metrics-port", str(metrics_port), "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max(2048, streams * PROMPT_LEN))]
    for a in addresses:
        args += ["--executor", a]
    scheduler = start("scheduler_service", args, log_dir / f"scheduler-{len(addresses)}.log")
    try:
        wait_healthy(listen, scheduler)
        wait_until(lambda: serving_count(metrics_port) == len(addresses), what="every executor serving")
        async with PagedServeClient(listen) as client:
            async def one(i: int) -> int:
                n = 0
                async for r in client.generate(prompt_token_ids=prompt(i), max_tokens=output_len,
                                               temperature=0.0, ignore_eos=True):
                    n += len(r.token_ids)
                return n

            cpu0, client0, t0 = proc_cpu_s(scheduler.pid), time.process_time(), time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(i) for i in range(streams))))
            wall, cpu = time.perf_counter() - t0, proc_cpu_s(scheduler.pid) - cpu0
            client_cpu = time.process_time() - client0
    finally:
        stop(scheduler)
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "scheduler_cpu": cpu / wall,
            "client_cpu": client_cpu / wall}


def report(mode: str, results: dict[int, dict[str, Any]], args: argparse.Namespace) -> None:
    base = results[min(results)]["tokens_per_s"]
    ceiling = 1000.0 / args.step_ms
    for k, r in sorted(results.items()):
        ideal = min(args.streams, k * args.max_num_seqs) * ceiling
        record = {"bench": "pool", "mode": mode, "executors": k, "streams": args.streams,
                  "step_ms": args.step_ms, "max_num_seqs": args.max_num_seqs, "output_len": args.output_len,
                  "tokens_per_s": round(r["tokens_per_s"]), "ratio_to_1": round(r["tokens_per_s"] / base, 2),
                  "of_ideal": round(r["tokens_per_s"] / ideal, 2), "scheduler_cpu": round(r["scheduler_cpu"], 2),
                  "scheduler_cpu_us_per_token": round(r["scheduler_cpu"] * r["wall_s"] / r["tokens"] * 1e6, 1),
                  "wall_s": round(r["wall_s"], 2), **machine()}
        record["executor_cpu"] = [round(c, 2) for c in r["executor_cpu"]]
        if "client_cpu" in r:
            record["client_cpu"] = round(r["client_cpu"], 2)
        if "steps_per_executor" in r:
            record["executor_busy"] = [round(s * args.step_ms / 1e3 / r["wall_s"], 2)
                                       for s in r["steps_per_executor"]]
        emit(record, args.json_out)
    print(f"{mode}: " + "  ".join(f"{k} executors {r['tokens_per_s']:.0f} tok/s ({r['tokens_per_s'] / base:.2f}x)"
                                  for k, r in sorted(results.items())), flush=True)


async def run(args: argparse.Namespace) -> None:
    counts = [int(x) for x in args.executors.split(",")]
    with tempfile.TemporaryDirectory(prefix="pagedserve-pool-bench-") as tmp:
        log_dir = Path(tmp)
        for mode in (["engine", "service"] if args.mode == "both" else [args.mode]):
            results: dict[int, dict[str, float]] = {}
            for k in counts:
                with executors(k, args.step_ms, log_dir) as started:
                    addresses, pids = [a for a, _ in started], [pid for _, pid in started]
                    cpu0 = [proc_cpu_s(pid) for pid in pids]
                    if mode == "engine":
                        results[k] = await engine_run(addresses, args.streams, args.output_len, args.max_num_seqs)
                    else:
                        results[k] = await service_run(addresses, args.streams, args.output_len,
                                                       args.max_num_seqs, log_dir)
                    cpu = [proc_cpu_s(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
                    results[k]["executor_cpu"] = [c / results[k]["wall_s"] for c in cpu]  # type: ignore[assignment]
            report(mode, results, args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executors", default="1,2,4")
    p.add_argument("--streams", type=int, default=512)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--max-num-seqs", type=int, default=128, help="per executor")
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--mode", choices=["engine", "service", "both"], default="both")
    p.add_argument("--json-out", default=None)
    uvloop.run(run(p.parse_args(argv)))


if __name__ == "__main__":
    main()
