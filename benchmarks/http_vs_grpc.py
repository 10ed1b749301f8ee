"""The same serving benchmark over gRPC and over the OpenAI-compatible HTTP API, side by side in one run.

Starts an executor (the model-free simulated one by default, so the front end's own cost is what shows; or
--torch for the embedded default model on CPU) and one scheduler with --http-listen, then sends the same
requests with `client bench`'s runner once per path, alternating --rounds times. For each path it prints
output tokens/s, TTFT and TPOT, the scheduler process's CPU time per output token (from /proc) and the
benchmark client's own, and the HTTP/gRPC ratios. The difference in the scheduler's CPU per token is the HTTP
layer's per-token cost on the server.

    python benchmarks/http_vs_grpc.py [--num-prompts 200] [--output-len 128] [--rounds 2] [--torch]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import emit, machine, service  # noqa: E402
from client.bench.datasets import BenchRequest  # noqa: E402
from client.bench.openai_backend import OpenAIBenchClient  # noqa: E402
from client.bench.runner import RunConfig, run_benchmark  # noqa: E402
from client.bench.stats import SLO, compute_metrics  # noqa: E402
from client.lib import PagedServeClient  # noqa: E402
from tests.procs import free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def requests(n: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
    return [BenchRequest(prompt_len=prompt_len, max_tokens=output_len,
                         prompt_token_ids=tuple(3 + (i * 7 + j) % 1000 for j in range(prompt_len)))
            for i in range(n)]


async def one_run(client: PagedServeClient | OpenAIBenchClient, reqs: list[BenchRequest], pid: int,
                  concurrency: int | None) -> dict[str, float]:
    cfg = RunConfig(ignore_eos=True, show_progress=False, max_concurrency=concurrency)
    before, client_before = cpu_seconds(pid), cpu_seconds(os.getpid())
    result = await run_benchmark(client, reqs, cfg)
    cpu, client_cpu = cpu_seconds(pid) - before, cpu_seconds(os.getpid()) - client_before
    m = compute_metrics(result.traces, result.duration, [50.0], SLO())
    tokens = sum(t.output_len for t in result.traces)
    return {"completed": m.completed, "output_tok_s": m.output_throughput, "ttft_ms": m.ttft.mean,
            "tpot_ms": m.tpot.mean, "cpu_us_per_token": 1e6 * cpu / max(tokens, 1),
            "client_cpu_us_per_token": 1e6 * client_cpu / max(tokens, 1)}


async def compare(grpc_address: str, http_url: str, pid: int, args: argparse.Namespace) -> dict[str, list]:
    reqs = requests(args.num_prompts, args.prompt_len, args.output_len)
    runs: dict[str, list[dict[str, float]]] = {"grpc": [], "http": []}
    async with PagedServeClient(grpc_address) as grpc_client, OpenAIBenchClient(http_url) as http_client:
        if not await http_client.check():
            raise SystemExit("HTTP API not answering")
        await one_run(grpc_client, reqs[:8], pid, None)  # warm-up both paths
        await one_run(http_client, reqs[:8], pid, None)
        for _ in range(args.rounds):
            runs["grpc"].append(await one_run(grpc_client, reqs, pid, args.max_concurrency))
            runs["http"].append(await one_run(http_client, reqs, pid, args.max_concurrency))
    return runs


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=200, help="requests per run")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (ignore_eos)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--rounds", type=int, default=2, help="runs per path, alternating")
    p.add_argument("--torch", action="store_true", help="the embedded default model on CPU, not --simulated")
    p.add_argument("--json-out", default=None, help="append the result line to this file")
    args = p.parse_args()
    executor_args = ["--device", "cpu", "--num-gpu-blocks", "4096"] if args.torch else ["--simulated"]
    http_port = free_port()
    with service("executor_service", executor_args, name="executor") as executor, \
            service("scheduler_service", ["--executor", executor.address, "--metrics-port", "-1",
                                          "--http-listen", f"127.0.0.1:{http_port}"], name="scheduler") as sched:
        runs = asyncio.run(compare(sched.address, f"http://127.0.0.1:{http_port}", sched.proc.pid, args))
    grpc, http = summary(runs["grpc"]), summary(runs["http"])
    record = {"benchmark": "http_vs_grpc", "executor": "torch-cpu" if args.torch else "simulated",
              "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "grpc": grpc, "http": http,
              "http_over_grpc_throughput": round(http["output_tok_s"] / grpc["output_tok_s"], 3),
              "http_over_grpc_cpu_per_token": round(http["cpu_us_per_token"] / grpc["cpu_us_per_token"], 3),
              "http_extra_cpu_us_per_token": round(http["cpu_us_per_token"] - grpc["cpu_us_per_token"], 2),
              "machine": machine()}
    emit(record, args.json_out)


if __name__ == "__main__":
    main()
