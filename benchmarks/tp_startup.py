"""Tensor-parallel executor start-up: process start to "executor ready" at --tensor-parallel-size 2, this tree
against a baseline tree, alternating in one run.

    python -m benchmarks.tp_startup --baseline-tree /work/main [--rounds 3] [--size 2]

Each round starts this tree's executor and the baseline's (the embedded default model, --device cpu), one after
the other, each in its own tree (cwd and PYTHONPATH), times from the process start to its "executor ready" log
line, and stops it (SIGTERM) before the next starts. A first, unreported start of each tree writes the
start-up cache both then reuse. Prints each start, the medians and their ratio. Imports no torch itself.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready ([0-9.]+) s after the process started")
START_TIMEOUT_S = 180.0


def start_once(tree: Path, size: int) -> tuple[float, float]:
    """(wall seconds from Popen to the ready line, the executor's own 'ready N s after the process started')."""
    with tempfile.TemporaryFile("w+") as log:
        began = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "executor_service", "--listen", "127.0.0.1:0", "--device",
                                 "cpu", "--tensor-parallel-size", str(size)], cwd=tree, stdout=log,
                                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(tree)))
        try:
            own = wait_ready(log, proc)
            wall = time.monotonic() - began
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    return wall, own


def wait_ready(log: IO[str], proc: subprocess.Popen[bytes]) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        found = READY.search(text)
        if found and "executor ready" in text:
            return float(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"executor exited with {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.02)
    raise TimeoutError("executor not ready in time")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-tree", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=2)
    args = parser.parse_args()
    trees = {"this": ROOT, "baseline": args.baseline_tree.resolve()}
    for tree in trees.values():  # warm-up: the start-up cache and the page cache
        start_once(tree, args.size)
    walls: dict[str, list[float]] = {name: [] for name in trees}
    for round_no in range(args.rounds):
        order = list(trees) if round_no % 2 == 0 else list(reversed(trees))
        for name in order:
            wall, own = start_once(trees[name], args.size)
            walls[name].append(wall)
            print(f"round {round_no + 1} {name:8s}: ready {wall:.2f} s after Popen (executor's own figure {own:.2f} s)",
                  flush=True)
    this, base = statistics.median(walls["this"]), statistics.median(walls["baseline"])
    print(f"median to ready at --tensor-parallel-size {args.size}: this {this:.2f} s, baseline {base:.2f} s, "
          f"ratio {this / base:.2f}; load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
