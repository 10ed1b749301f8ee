"""Where an executor's wall time goes between its steps, from its step log (executor --step-log FILE) (#29).

    python -m benchmarks.step_gaps FILE [--run-gap-ms 50]

Each record has the step's start (start_ns) and length (total_ns, of which forward_ns in the forward passes) on
the process's clock, and when the Execute stream got control back after answering the step before (resumed_ns).
The log is cut into runs where the executor idled longer than --run-gap-ms (a benchmark's warm-up, then its timed
requests); per run: wall (first start to last end), busy (the steps' total_ns), and the idle time between steps,
split into answering (the last result handed to gRPC until the stream resumed) and waiting for and reading the
next step's message, by the kind of step that came before (prefill, or decode by rows). One JSON line per run.
"""

from __future__ import annotations

import argparse
import json
from itertools import pairwise
from pathlib import Path
from typing import Any

Step = dict[str, Any]
KINDS = ((8, "decode <= 8"), (32, "decode 9-32"), (64, "decode 33-64"))


def read_steps(path: Path) -> list[Step]:
    """The records that have a start (older executors' have none), in the order they started."""
    steps = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted((s for s in steps if s.get("start_ns")), key=lambda s: s["start_ns"])


def gap_ms(before: Step, after: Step) -> float:
    return (after["start_ns"] - before["start_ns"] - before["total_ns"]) / 1e6


def split_runs(steps: list[Step], run_gap_ms: float) -> list[list[Step]]:
    runs: list[list[Step]] = [[steps[0]]] if steps else []
    for before, after in pairwise(steps):
        if gap_ms(before, after) > run_gap_ms:
            runs.append([])
        runs[-1].append(after)
    return runs


def kind(step: Step) -> str:
    if step["tokens"] > step["seqs"]:
        return "prefill"
    return next((name for rows, name in KINDS if step["seqs"] <= rows), "decode > 64")


def summarize(run: list[Step]) -> dict[str, Any]:
    wall = (run[-1]["start_ns"] + run[-1]["total_ns"] - run[0]["start_ns"]) / 1e9
    busy = sum(s["total_ns"] for s in run) / 1e9
    answering = waiting = 0.0
    by_kind: dict[str, list[float]] = {}
    for before, after in pairwise(run):
        by_kind.setdefault(kind(before), []).append(gap_ms(before, after))
        if after.get("resumed_ns"):
            answering += (after["resumed_ns"] - before["start_ns"] - before["total_ns"]) / 1e9
            waiting += (after["start_ns"] - after["resumed_ns"]) / 1e9
    return {"steps": len(run), "wall_s": round(wall, 3), "busy_s": round(busy, 3),
            "forward_s": round(sum(s["forward_ns"] for s in run) / 1e9, 3), "idle_s": round(wall - busy, 3),
            "answering_s": round(answering, 3), "waiting_s": round(waiting, 3),
            "gap_ms_median_by_kind": {k: round(sorted(v)[len(v) // 2], 2) for k, v in by_kind.items()},
            "gap_s_by_kind": {k: round(sum(v) / 1e3, 3) for k, v in by_kind.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("step_log", type=Path)
    p.add_argument("--run-gap-ms", type=float, default=50.0, help="an idle gap longer than this starts a new run")
    args = p.parse_args(argv)
    for run in split_runs(read_steps(args.step_log), args.run_gap_ms):
        print(json.dumps(summarize(run)))


if __name__ == "__main__":
    main()
