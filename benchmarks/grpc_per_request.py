"""Per-request cost of the gRPC Generate path, A/B across source trees, interleaved in one run.

    python benchmarks/grpc_per_request.py --tree base=/tmp/base --tree head=. [--requests 500] [--rounds 4]
        [--stream-tokens 512] [--json-out FILE]

Each tree (LABEL=PATH, e.g. a `git worktree add /tmp/base COMMIT`) gets a stack of its own, started from that tree
(cwd and PYTHONPATH): the simulated executor (no model, no compute: what shows is the service's own cost) and a
scheduler with its default layout. All stacks start first and stay up; then each round times, for each tree in
turn (the order alternating from round to round, so that neither tree always follows the other):
- `--requests` sequential short Generate calls on one channel (4-token prompt, max_tokens cycling 1-4,
  ignore_eos), as the soak test test_sequential_requests_grow_no_process sends them: wall time per call, and the
  scheduler's CPU time per call (the engine core and its api-server processes, from /proc);
- one streamed call of `--stream-tokens` tokens: wall time per token.
Figures are medians over the rounds; the ratios are to the first tree's, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvloop

from client.bench.record import emit, machine
from client.lib import PagedServeClient
from client.local import child_pids, loopback, stop, wait_healthy
from client.port_file import wait_ports

TICKS = os.sysconf("SC_CLK_TCK")
PROMPT = [65] * 4


@dataclass(slots=True)
class TreeStack:
    label: str
    address: str
    scheduler: subprocess.Popen[bytes]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def scheduler_cpu(pid: int) -> float:
    """CPU seconds of the scheduler process and its children (api servers)."""
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in child_pids(pid))


def start_in(tree: Path, module: str, args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], int]:
    """`python -m module` run from `tree` (its code, not this one's) on a port it picks; the process and port."""
    ports = log.with_suffix(".ports")
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, "--listen", "127.0.0.1:0", "--port-file", str(ports),
                                 *args], cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        return proc, wait_ports(ports, ("listen",), proc, timeout=300.0)["listen"]
    except BaseException:
        stop(proc)
        raise


@contextlib.contextmanager
def tree_stack(label: str, tree: Path, log_dir: Path) -> Iterator[TreeStack]:
    executor, ex_port = start_in(tree, "executor_service", ["--simulated"], log_dir / f"{label}-executor.log")
    try:
        scheduler, port = start_in(tree, "scheduler_service", ["--executor", loopback(ex_port), "--metrics-port", "-1"],
                                   log_dir / f"{label}-scheduler.log")
        try:
            wait_healthy(loopback(port), scheduler, executor, timeout=300.0)
            yield TreeStack(label, loopback(port), scheduler)
        finally:
            stop(scheduler)
    finally:
        stop(executor)


async def sequential(client: PagedServeClient, n: int) -> None:
    for i in range(n):
        async for _ in client.generate(prompt_token_ids=PROMPT, max_tokens=1 + i % 4, ignore_eos=True):
            pass


async def streamed(client: PagedServeClient, tokens: int) -> int:
    got = 0
    async for response in client.generate(prompt_token_ids=PROMPT, max_tokens=tokens, ignore_eos=True):
        got += len(response.token_ids)
    return got


async def measure_round(stack: TreeStack, requests: int, stream_tokens: int) -> dict[str, float]:
    async with PagedServeClient(stack.address) as client:
        await sequential(client, 20)  # the channel connected and warm
        cpu0, t0 = scheduler_cpu(stack.scheduler.pid), time.perf_counter()
        await sequential(client, requests)
        wall, cpu = time.perf_counter() - t0, scheduler_cpu(stack.scheduler.pid) - cpu0
        t0 = time.perf_counter()
        got = await streamed(client, stream_tokens)
        stream_wall = time.perf_counter() - t0
    if got != stream_tokens:
        raise RuntimeError(f"{stack.label}: the streamed call gave {got} tokens, not {stream_tokens}")
    return {"request_us": wall / requests * 1e6, "scheduler_cpu_us": cpu / requests * 1e6,
            "stream_token_us": stream_wall / stream_tokens * 1e6}


async def run_rounds(stacks: list[TreeStack], args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {s.label: [] for s in stacks}
    for stack in stacks:  # warm-up: first calls, the collector's first generations
        async with PagedServeClient(stack.address) as client:
            await sequential(client, args.requests // 2)
    for r in range(args.rounds):
        order = stacks if r % 2 == 0 else stacks[::-1]
        for stack in order:
            figures = await measure_round(stack, args.requests, args.stream_tokens)
            results[stack.label].append(figures)
            print(f"round {r} {stack.label}: " + ", ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    return results


def report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    medians = {label: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for label, runs in results.items()}
    first = next(iter(medians.values()))
    print(f"{'tree':<12} {'us/request':>11} {'sched CPU us/req':>17} {'us/stream token':>16}   ratios to first")
    for label, m in medians.items():
        ratios = " ".join(f"{m[k] / first[k]:.3f}" for k in m)
        print(f"{label:<12} {m['request_us']:>11.1f} {m['scheduler_cpu_us']:>17.1f} {m['stream_token_us']:>16.1f}"
              f"   {ratios}")
    emit({"benchmark": "grpc_per_request", "requests": args.requests, "rounds": args.rounds,
          "stream_tokens": args.stream_tokens, "medians": medians, "machine": machine()}, args.json_out)


def parse_tree(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not Path(path, "scheduler_service").is_dir():
        raise argparse.ArgumentTypeError(f"expected LABEL=PATH to a pagedserve tree, got {text!r}")
    return label, Path(path).resolve()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=parse_tree, action="append", required=True, help="LABEL=PATH (repeat: 2 or more)")
    p.add_argument("--requests", type=int, default=500, help="sequential short calls per round and tree")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=512, help="tokens of the streamed call per round and tree")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="grpc-per-request-") as tmp, contextlib.ExitStack() as stack:
        stacks = [stack.enter_context(tree_stack(label, tree, Path(tmp))) for label, tree in args.tree]
        report(uvloop.run(run_rounds(stacks, args)), args)


if __name__ == "__main__":
    main()
