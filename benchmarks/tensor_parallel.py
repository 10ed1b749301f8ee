"""Decode tokens/s of the torch executor at --tensor-parallel-size 1 and 2, side by side in one run.

    python -m benchmarks.tensor_parallel [--batch-sizes 1,16,64] [--steps 32] [--prompt-len 32]
                                         [--model DIR] [--device cpu|cuda] [--cores 2] [--repeats 3]

Every configuration is an executor process (`python -m executor_service`) on the same weights (--model,
or the embedded default), driven directly over one Execute stream (no scheduler): one step prefills the
N requests, 2 untimed decode steps warm up, then K greedy decode steps are timed from the first write to
the last read; tokens/s = N * K / that time. All executors are started first and the runs alternate
between them (repeat r of every configuration before repeat r+1), so a change in machine load hits all
alike; each figure is the median of --repeats.

On the CPU the configurations share --cores cores: TP=1 with that many threads, TP=2 with half each
(OMP_NUM_THREADS), plus TP=1 on half the cores for reference. On CUDA, TP=2 needs two devices.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.executor import executor_run, prompts
from client.local import free_port, stop, wait_healthy
from protos.pagedserve.v1 import executor_pb2, executor_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Setup:
    name: str
    tp: int
    threads: int
    address: str = ""
    proc: subprocess.Popen[bytes] | None = None


def start(setup: Setup, args: argparse.Namespace, log: Path) -> None:
    setup.address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(setup.threads))
    cmd = [sys.executable, "-m", "executor_service", "--listen", setup.address, "--device", args.device,
           "--num-gpu-blocks", str(args.num_blocks), "--num-cpu-blocks", "0", "--tensor-parallel-size", str(setup.tp)]
    if args.model:
        cmd += ["--model", args.model]
    with open(log, "wb") as out:
        setup.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_healthy(setup.address, setup.proc, timeout=300.0)


async def decode_run(stub: executor_pb2_grpc.ExecutorStub, batch: list[list[int]], steps: int,
                     block_size: int) -> float:
    """Wall seconds of `steps` decode steps of the batch on a fresh stream (benchmarks/executor.py's run)."""
    wall, _ = await executor_run(stub, batch, steps, block_size)
    return wall


async def bench(setups: list[Setup], args: argparse.Namespace) -> dict[tuple[str, int], float]:
    channels = [grpc.aio.insecure_channel(s.address) for s in setups]
    stubs = [executor_pb2_grpc.ExecutorStub(c) for c in channels]
    describe = await stubs[0].Describe(executor_pb2.DescribeRequest())
    vocab, block = min(describe.vocab_size, 4096), describe.block_size
    walls: dict[tuple[str, int], list[float]] = {}
    try:
        for stub in stubs:
            await decode_run(stub, prompts(1, args.prompt_len, vocab), 4, block)  # warm-up
        for n in args.batch_sizes:
            batch = prompts(n, args.prompt_len, vocab)
            for _ in range(args.repeats):
                for setup, stub in zip(setups, stubs, strict=True):
                    walls.setdefault((setup.name, n), []).append(await decode_run(stub, batch, args.steps, block))
            line = "  ".join(f"{s.name} {n * args.steps / statistics.median(walls[s.name, n]):8.1f}" for s in setups)
            print(f"batch {n:>3}: {line} tok/s", file=sys.stderr, flush=True)
    finally:
        for c in channels:
            await c.close()
    return {key: key[1] * args.steps / statistics.median(w) for key, w in walls.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--cores", type=int, default=2, help="CPU cores all configurations share")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    half = max(1, args.cores // 2)
    setups = [Setup(f"tp1x{args.cores}t", 1, args.cores), Setup(f"tp2x{half}t", 2, half),
              Setup(f"tp1x{half}t", 1, half)]
    if args.device == "cuda":
        setups = [Setup("tp1", 1, half), Setup("tp2", 2, half)]
    logs = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    try:
        for s in setups:
            start(s, args, logs / f"{s.name}.log")
        result = asyncio.run(bench(setups, args))
    finally:
        for s in setups:
            if s.proc is not None:
                stop(s.proc)
    base, tp2 = setups[0].name, setups[1].name
    print(f"\ndecode tok/s, {args.steps} steps after a {args.prompt_len}-token prompt, median of {args.repeats}; "
          f"model={args.model or 'embedded default'} device={args.device} (logs in {logs})")
    print(f"{'batch':>5} | " + " | ".join(f"{s.name:>10}" for s in setups) + f" | {tp2} / {base}")
    for n in args.batch_sizes:
        cells = " | ".join(f"{result[s.name, n]:>10.1f}" for s in setups)
        print(f"{n:>5} | {cells} | {result[tp2, n] / result[base, n]:>6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
