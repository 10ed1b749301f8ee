"""Two engine cores with one executor each vs one engine core with two executors, behind one front-end (#28):
delivered tokens/s of --streams endless client-library streams over a --window-second window, the simulated
executors' steps compute-bound (--step-ms per step), layouts alternated --rounds times.

    python -m benchmarks.core_scaling [--streams 128] [--step-ms 20] [--window 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import tempfile
import time
from pathlib import Path

from client.lib import PagedServeClient
from client.local import free_port, start, stop, wait_healthy


def wait_ready(log: Path, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while "engine core ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"engine core not ready: {log}")
        time.sleep(0.05)


def start_layout(cores: int, step_ms: int, logs: Path) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """cores engine cores sharing two executors between them; one front-end over all; its public address."""
    procs: list[subprocess.Popen[bytes]] = []
    executors = []
    for i in range(2):
        address = f"127.0.0.1:{free_port()}"
        procs.append(start("executor_service", ["--listen", address, "--simulated", "--sim-step-latency-ms",
                                                str(step_ms), "--num-gpu-blocks", "100000"], logs / f"ex{i}.log"))
        wait_healthy(address, procs[-1])
        executors.append(address)
    links = []
    for i in range(cores):
        link = f"tcp://127.0.0.1:{free_port()}"
        mine = executors if cores == 1 else [executors[i]]
        log = logs / f"core{i}.log"
        procs.append(start("scheduler_service", ["--engine-core-listen", link, "--api-server-count", "0",
                                                 "--metrics-port", "-1", "--max-num-seqs", "1024",
                                                 *[a for e in mine for a in ("--executor", e)]], log))
        wait_ready(log, procs[-1])
        links += ["--engine-core", link]
    public = f"127.0.0.1:{free_port()}"
    procs.append(start("scheduler_service.frontend", ["--listen", public, *links], logs / "frontend.log"))
    wait_healthy(public, procs[-1])
    return public, procs


async def measure(address: str, streams: int, window: float) -> float:
    tokens = [0]

    async def one(client: PagedServeClient, i: int) -> None:
        async for r in client.generate(prompt_token_ids=[5 + i % 50, 6, 7, 8], max_tokens=4000, ignore_eos=True,
                                       temperature=0.0):
            tokens[0] += len(r.token_ids)

    clients = [PagedServeClient(address) for _ in range(-(-streams // 128))]
    tasks = [asyncio.create_task(one(clients[i // 128], i)) for i in range(streams)]
    try:
        await asyncio.sleep(2.0)  # every stream admitted and decoding
        failed = [t for t in tasks if t.done()]
        if failed:
            raise RuntimeError(f"{len(failed)} streams ended early: {failed[0].exception()!r}")
        t0, n0 = time.monotonic(), tokens[0]
        await asyncio.sleep(window)
        return (tokens[0] - n0) / (time.monotonic() - t0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--step-ms", type=int, default=20)
    p.add_argument("--window", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[float]] = {"1 core x 2 executors": [], "2 cores x 1 executor": []}
    for _ in range(args.rounds):
        for cores, name in ((1, "1 core x 2 executors"), (2, "2 cores x 1 executor")):
            with tempfile.TemporaryDirectory(prefix="core-scaling-") as logs:
                address, procs = start_layout(cores, args.step_ms, Path(logs))
                try:
                    results[name].append(round(asyncio.run(measure(address, args.streams, args.window))))
                finally:
                    for proc in reversed(procs):
                        stop(proc)
    print(json.dumps({"streams": args.streams, "step_ms": args.step_ms, "tok_s": results,
                      "ceiling_tok_s": round(args.streams / (args.step_ms / 1000))}, indent=2))


if __name__ == "__main__":
    main()
