"""A decode step's "rest" (all but the linears and the attention) with and without the eighth session's cuts, A/B
in one process (#29).

    python -m benchmarks.step_rest [--threads 1,2] [--rows 5,20,64,128] [--repeats 15]

TorchBackend.execute on forward_steps' decode shapes (N sequences at 300 tokens of context), with its --split
timers around the linears and the attention calls. "before" switches the cuts off in this same process: RoPE's
cos and sin computed per step (not gathered from the cache), the final rows gathered even when every row is
sampled, the sampler's full path for plain greedy rows, and validate_item per item. The variants alternate step by
step, each thread count in turn; per (rows, threads, variant) the step of the least wall time is kept, and its
rest printed (ms) with the ratio before / after. Run it under the executor's OpenMP environment
(GOMP_SPINCOUNT=10000 under auto, as forward_steps re-executes itself with).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.forward_steps import GREEDY, NUM_BLOCKS, in_passing_thread, make_backends, step_items, time_parts
from benchmarks.vs_transformers import DEFAULT_CACHE, ensure_model
from executor_service.backend import BatchItem
from executor_service.runner import torch_backend
from executor_service.runner.torch_backend import Batch, TorchBackend

LENGTH = 300


@contextmanager
def before_cuts(backend: TorchBackend) -> Iterator[None]:
    """The step as it was before the cuts, for the duration."""
    model, saved = backend.model, (torch_backend.plain_greedy, Batch.rows_to_keep)
    cache = model.cos_sin
    model.cos_sin = cache.tables  # type: ignore[assignment]  # RopeTables.cos_sin: computed per step
    torch_backend.plain_greedy = lambda sampling: False
    Batch.rows_to_keep = lambda batch: batch.output_rows  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        model.cos_sin = cache
        torch_backend.plain_greedy, Batch.rows_to_keep = saved  # type: ignore[method-assign]


def best_rest(backend: TorchBackend, items: list[BatchItem], threads: list[int], repeats: int,
              spent: dict[str, float]) -> dict[tuple[int, str], float]:
    """Per (threads, variant): the rest (ms) of the step of least wall time, the variants alternating."""
    best: dict[tuple[int, str], tuple[float, float]] = {}
    for round_ in range(repeats + 1):  # the first round warms up
        for n in threads:
            torch.set_num_threads(n)
            for variant in ("before", "after"):
                with before_cuts(backend) if variant == "before" else _nothing():
                    spent.update(dict.fromkeys(spent, 0.0))
                    start = time.perf_counter()
                    backend.execute(items)
                    wall = time.perf_counter() - start
                rest = wall - sum(spent.values())
                if round_ and wall < best.get((n, variant), (float("inf"), 0.0))[0]:
                    best[(n, variant)] = (wall, rest)
    return {key: round(rest * 1e3, 3) for key, (_, rest) in best.items()}


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEFAULT_CACHE / "bench-llama-32m"))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="5,20,64,128")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args(argv)
    model = ensure_model(Path(args.model))
    backend = in_passing_thread(lambda: make_backends(model, [""])["default"])
    backend.on_forward_thread(lambda: time_rests(backend, args))


def time_rests(backend: TorchBackend, args: argparse.Namespace) -> None:
    """main's timings, on the backend's forward thread (one OpenMP team: forward_steps.in_passing_thread)."""
    spent = time_parts(backend)
    threads = [int(t) for t in args.threads.split(",")]
    print(json.dumps({"gomp_spincount": os.environ.get("GOMP_SPINCOUNT"), "load": os.getloadavg()}), flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        items = step_items("decode", rows, LENGTH, backend.info.vocab_size, NUM_BLOCKS // 128)
        backend.execute([BatchItem(i.request_id, i.token_ids, LENGTH, 0, LENGTH, i.block_table, False, GREEDY)
                         for i in items])
        rest = best_rest(backend, items, threads, args.repeats, spent)
        for n in threads:
            before, after = rest[(n, "before")], rest[(n, "after")]
            print(json.dumps({"rows": rows, "threads": n, "rest_ms_before": before, "rest_ms_after": after,
                              "ratio": round(before / after, 2)}), flush=True)
    print(json.dumps({"load_after": os.getloadavg()}))


if __name__ == "__main__":
    main()
