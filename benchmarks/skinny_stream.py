"""The skinny linear kernel alone against a plain read of the same bytes and the packed GEMMs, at 1 and 2 threads
(#29).

    python -m benchmarks.skinny_stream [--rows 1,5,10,20,32] [--threads 1,2] [--repeats 7]
        [--candidates skinny,read] [--per-shape]

One pass of the skinny kernel (torch.ops.pagedserve_model.skinny_panel_linear, over the weights packed once into
its panels) over weights of the benchmark model's linear shapes (8 layers of qkv 1024 x 512, o 512 x 512, gate_up
3072 x 512, down 512 x 1536, then the LM head 8192 x 512: 117 MB of float32, more than the L3, as a decode step
reads them) at M rows, against a read of the same tensors (torch's sum, one call
per weight: the same number of parallel regions). --candidates adds the packed GEMMs dense() can take instead
(mkl, onednn: model/packed.py, each weight packed once), F.linear (linear) and the skinny kernel over the weight
in place (in_place: what a linear takes before its packs are made). Every (candidate, threads) pair is
timed in wall-clock time, best of --repeats, the thread counts and candidates interleaved round by round. Prints
per row count: ms, GB/s and GFLOP/s of each candidate at each thread count, the skinny kernel's share of the
read's bandwidth and each candidate's speedup from the first thread count to the others; --per-shape, the same
per linear kind (its 8 weights, or the LM head's one). Runs under the executor's OpenMP environment
(--cpu-omp-wait-policy auto; re-executes itself with it where the environment lacks it). Skips (a JSON line saying
why) without AVX-512.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch

from client.switches import env_switch
from executor_service.model.packed import GEMMS, PackedWeight, available, dense, pack, skinny_available
from executor_service.placement import OMP_VARIABLES, omp_environment

SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)] * 8 + [(8192, 512)]
REEXEC_ENV = "PAGEDSERVE_SKINNY_STREAM_REEXEC"


def apply_executor_omp() -> None:
    """Re-execute under the executor's default OpenMP environment (libgomp reads it once, when torch loads)."""
    wanted = omp_environment("auto", -1)
    if wanted and not any(os.environ.get(k) for k in OMP_VARIABLES) and not env_switch(REEXEC_ENV, False):
        env = dict(os.environ) | wanted | {REEXEC_ENV: "1"}
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.skinny_stream", *sys.argv[1:]], env)


def best_seconds(runs: dict[str, Callable[[], None]], threads: list[int], repeats: int
                 ) -> dict[tuple[str, int], float]:
    """Best wall-clock seconds of each run() at each thread count, the counts and runs interleaved round by round."""
    best = {(name, n): float("inf") for name in runs for n in threads}
    for _ in range(repeats):
        for n in threads:
            torch.set_num_threads(n)
            for name, run in runs.items():
                run()  # warm: the team started, x in cache; the weights still stream from memory (117 MB > L3)
                start = time.perf_counter()
                run()
                best[(name, n)] = min(best[(name, n)], time.perf_counter() - start)
    return best


Op = Callable[[torch.Tensor, torch.Tensor], object]


def candidate_ops(names: list[str], weights: list[torch.Tensor]) -> dict[str, Op]:
    """Each candidate as op(x, weight); the packed GEMMs over packs of `weights` made here, once."""
    ops: dict[str, Op] = {"in_place": lambda x, w: torch.ops.pagedserve_model.skinny_linear(x, w, None),
                          "read": lambda x, w: w.sum(), "linear": torch.nn.functional.linear}
    if "skinny" in names:
        ops["skinny"] = panels_op({id(w): torch.ops.pagedserve_model.pack_skinny_panels(w) for w in weights})
    for gemm in GEMMS:
        if gemm in names and available(gemm):
            ops[gemm] = packed_op({id(w): pack(w, gemm) for w in weights})
    return {name: ops[name] for name in names if name in ops}


def panels_op(panels: dict[int, torch.Tensor]) -> Op:
    return lambda x, w: torch.ops.pagedserve_model.skinny_panel_linear(x, panels[id(w)], w.shape[0], None)


def packed_op(packs: dict[int, PackedWeight]) -> Op:
    return lambda x, w: dense(x, w, None, packs[id(w)])


def candidate_runs(names: list[str], weights: list[torch.Tensor], x: dict[int, torch.Tensor]
                   ) -> dict[str, Callable[[], None]]:
    """One pass over `weights` per candidate, x by in_features."""

    def one_pass(op: Op) -> Callable[[], None]:
        def run() -> None:
            for w in weights:
                op(x[w.shape[1]], w)
        return run

    return {name: one_pass(op) for name, op in candidate_ops(names, weights).items()}


def row_record(rows: int, weights: list[torch.Tensor], threads: list[int], repeats: int, names: list[str]
               ) -> dict[str, object]:
    """Each candidate at `rows` rows: ms, GB/s, GFLOP/s, the kernel's share of the read, speedups."""
    x = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
    runs = candidate_runs(names, weights, x)
    with torch.inference_mode():
        best = best_seconds(runs, threads, repeats)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flops = 2 * rows * sum(w.numel() for w in weights)
    record: dict[str, object] = {"rows": rows}
    for n in threads:
        record[f"{n}t"] = {name: {"ms": round(best[(name, n)] * 1e3, 2),
                                  "gb_s": round(nbytes / best[(name, n)] / 1e9, 1),
                                  "gflop_s": round(flops / best[(name, n)] / 1e9, 1)} for name in runs}
        if "skinny" in runs and "read" in runs:
            record[f"{n}t_skinny_of_read"] = round(best[("read", n)] / best[("skinny", n)], 2)
    for n in threads[1:]:
        record[f"speedup_{n}t"] = {name: round(best[(name, threads[0])] / best[(name, n)], 2) for name in runs}
    return record


KINDS = {(1024, 512): "qkv", (512, 512): "o", (3072, 512): "gate_up", (512, 1536): "down", (8192, 512): "lm_head"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,5,10,20,32", help="comma-separated row counts (a decode step's sequences)")
    p.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--candidates", default="skinny,read",
                   help="comma-separated, of skinny (over its panels, as the packed linears take it), in_place (the "
                   "skinny kernel over the weight in place, as before the packs), read, mkl, onednn (packed GEMMs), "
                   "linear (F.linear)")
    p.add_argument("--per-shape", action="store_true", help="also time each linear kind's weights alone")
    args = p.parse_args(argv)
    apply_executor_omp()
    if not skinny_available():
        print(json.dumps({"bench": "skinny_stream",
                          "skipped": "no skinny kernel here (needs AVX-512 or AVX2 and FMA)"}))
        return
    torch.manual_seed(0)
    weights = [torch.randn(n, k) for n, k in SHAPES]
    threads = [int(t) for t in args.threads.split(",")]
    omp = {k: os.environ[k] for k in OMP_VARIABLES if os.environ.get(k)}
    print(json.dumps({"bench": "skinny_stream", "weight_mb": round(sum(w.numel() * 4 for w in weights) / 2**20),
                      "omp": omp, "load": os.getloadavg()}), flush=True)
    names = args.candidates.split(",")
    groups = {"all": weights}
    if args.per_shape:
        groups |= {kind: [w for w in weights if tuple(w.shape) == shape] for shape, kind in KINDS.items()}
    for rows in (int(r) for r in args.rows.split(",")):
        for group, chosen in groups.items():
            record = row_record(rows, chosen, threads, args.repeats, names)
            print(json.dumps({"weights": group, **record} if args.per_shape else record), flush=True)
    print(json.dumps({"load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
