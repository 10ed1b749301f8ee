"""The torch executor's forward steps in process, against the roofline, in CPU time (robust on a shared machine).

    python -m benchmarks.forward_steps [--model DIR] [--repeats 5] [--attention cpu,reference] [--json-out FILE]
    python -m benchmarks.forward_steps --threads 1,2 [--split] [--omp-wait-policy auto] [--kv-cache-dtype float16]
        [--compete 1,11]

TorchBackend.execute (batch building, model, paged attention, sampler; no gRPC) on typical step shapes of the
offline benchmark's model: prefill steps (32 x 64 and 8 x 256 prompt tokens) and decode steps (one token for
each of N sequences at a context length). Each shape: the best of --repeats timings of this thread's CPU time
(time.thread_time: other processes on the machine do not count; cache and memory contention still do).
Beside each: model GFLOP/s (linears + LM head + attention over the step's contexts, benchmarks/roofline.py) as a
% of the matmul peak measured first in the same process with the same clock, and for decode the bytes the step
must move (weights once + K/V read and written) per second as a % of the measured streaming-read bandwidth.
One thread (torch.set_num_threads(1)), unless --threads (#29): then each of THREAD_SHAPES is timed in wall-clock
time at each thread count, the counts interleaved round by round, with the speedup over the first count and the
serial fraction that speedup implies (Amdahl: s = (n / speedup - 1) / (n - 1)), and the speedups that fraction
predicts at 16 and 64 threads (two controls first: a torch GEMM, what a second thread adds to compute, and a
256 MB read, what it adds to memory bandwidth), under --omp-wait-policy and --omp-spin-count (default: the executor's
defaults; the benchmark re-executes itself with OMP_WAIT_POLICY / GOMP_SPINCOUNT set, since libgomp reads them once,
when torch loads).
--split adds, per step and thread count, the time inside the model's linears and its attention calls during the
best execute and the rest (the serial part: Python between the kernels, serial kernels, batch building, sampler).
--compete BURST_MS,PERIOD_MS adds, per step, how much slower the top thread count runs while another process
takes BURST_MS of CPU every PERIOD_MS (as the scheduler side's processes do on a shared box): the medians of
interleaved rounds' means, quiet and competed, the share of a core the competitor took (measured), the slowdown,
and its amplification: the slowdown's excess over the share of the team's cores the competitor took (1.0: the team
lost only that CPU; 2.0 at 2 threads: a preempted thread stalled the other as long, at the barrier that ends each
parallel region).
--attention times several attention implementations side by side (one backend each, their timings interleaved
round by round) and prints each one's speedup over the last named.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from benchmarks.roofline import ModelShape, limits_record, measure_limits
from benchmarks.vs_llamacpp import cpu_seconds
from benchmarks.vs_transformers import DEFAULT_CACHE, ensure_model
from client.switches import env_switch
from executor_service.attention import ENV_VAR
from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.model import ModelOps
from executor_service.model.parallel import Linear
from executor_service.placement import OMP_VARIABLES, omp_environment
from executor_service.runner.torch_backend import TorchBackend

SHAPES = [("prefill", 32, 64), ("prefill", 8, 256), ("decode", 128, 100), ("decode", 64, 200),
          ("decode", 16, 300), ("decode", 4, 400)]
THREAD_SHAPES = [("decode", 5, 300), ("decode", 20, 300), ("decode", 64, 300), ("decode", 128, 300),
                 ("prefill", 1, 512), ("prefill", 4, 512)]
GREEDY = SamplingConfig(temperature=0.0)
NUM_BLOCKS = 4096
T = TypeVar("T")


def step_items(kind: str, n: int, length: int, vocab: int, blocks_each: int) -> list[BatchItem]:
    rng = random.Random(n * 1000 + length)
    items = []
    for i in range(n):
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        start = 0 if kind == "prefill" else length - 1
        items.append(BatchItem(str(i), tokens, length, start, length - start, table, True, GREEDY))
    return items


def make_backends(model: Path, attention: list[str], huge_pages: bool = True,
                  kv_cache_dtype: str = "auto") -> dict[str, TorchBackend]:
    """One backend per attention implementation (PAGEDSERVE_ATTENTION value; "" = the executor's default)."""
    backends = {}
    saved = os.environ.get(ENV_VAR)
    try:
        for name in attention:
            os.environ[ENV_VAR] = name
            backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", num_gpu_blocks=NUM_BLOCKS,
                                                         cpu_huge_pages=huge_pages, kv_cache_dtype=kv_cache_dtype))
            backend.wait_for_packing()  # the packing after ready: done and swapped in before timing
            backends[name or "default"] = backend
    finally:
        if saved is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = saved
    return backends


def time_step(backends: dict[str, TorchBackend], kind: str, items: list[BatchItem], length: int,
              repeats: int) -> dict[str, float]:
    """Best thread CPU seconds of one execute per backend, the backends interleaved round by round."""
    for backend in backends.values():
        if kind == "decode":  # the context must be in the cache
            backend.execute([BatchItem(i.request_id, i.token_ids, length, 0, length, i.block_table, False, GREEDY)
                             for i in items])
        backend.execute(items)  # warm-up
    best = dict.fromkeys(backends, float("inf"))
    for _ in range(repeats):
        for name, backend in backends.items():
            start = time.thread_time()
            backend.execute(items)
            best[name] = min(best[name], time.thread_time() - start)
    return best


def time_threads(backend: TorchBackend, kind: str, items: list[BatchItem], length: int, threads: list[int],
                 repeats: int, spent: dict[str, float] | None = None,
                 parts: dict[int, dict[str, float]] | None = None) -> dict[int, float]:
    """Best wall-clock seconds of one execute at each thread count, the counts interleaved round by round. With
    `spent` (time_parts' timers) `parts` gets, per count, the seconds in each part during its best execute."""
    if kind == "decode":
        backend.execute([BatchItem(i.request_id, i.token_ids, length, 0, length, i.block_table, False, GREEDY)
                         for i in items])
    best = dict.fromkeys(threads, float("inf"))
    for round_ in range(repeats + 1):  # the first round warms up
        for n in threads:
            torch.set_num_threads(n)
            if spent is not None:
                spent.update(dict.fromkeys(spent, 0.0))
            start = time.perf_counter()
            backend.execute(items)
            seconds = time.perf_counter() - start
            if round_ and seconds < best[n]:
                best[n] = seconds
                if spent is not None and parts is not None:
                    parts[n] = dict(spent)
    return best


COMPETITOR = """
import os, sys, time
burst, period = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
parent = os.getppid()
while os.getppid() == parent:  # not past its benchmark, however that ended
    end = time.perf_counter() + burst
    while time.perf_counter() < end:
        pass
    time.sleep(period - burst)
"""


@dataclass(frozen=True, slots=True)
class Compete:
    """A competing process: burst_ms of busy looping every period_ms."""

    burst_ms: float
    period_ms: float

    @classmethod
    def parse(cls, text: str) -> Compete:
        burst, comma, period = text.partition(",")
        compete = cls(float(burst), float(period)) if comma else None
        if compete is None or not (math.isfinite(compete.period_ms) and 0 < compete.burst_ms < compete.period_ms):
            raise argparse.ArgumentTypeError(f"--compete {text!r}: BURST_MS,PERIOD_MS with 0 < BURST_MS < PERIOD_MS")
        return compete

    def start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", COMPETITOR, str(self.burst_ms), str(self.period_ms)])


@dataclass(frozen=True, slots=True)
class Competed:
    """Median seconds of an execute, quiet and competed, and the share of one core the competitor took."""

    quiet: float
    competed: float
    share: float

    @property
    def slowdown(self) -> float:
        return self.competed / self.quiet

    def amplification(self, threads: int) -> float:
        """How many times the CPU it took the team lost: (slowdown - 1) over its share of the team's cores."""
        return (self.slowdown - 1) / (self.share / threads) if self.share > 0 else math.nan


def time_competed(backend: TorchBackend, items: list[BatchItem], threads: int, repeats: int,
                  compete: Compete) -> Competed:
    """An execute at `threads` threads, quiet and with the competitor running, the two interleaved round by round:
    the medians of the rounds' means (a round runs the step for ~0.5 s, many of the competitor's periods), and the
    share of a core the competitor took in its rounds (its CPU time over their wall time). The competitor starts
    once per call and is stopped (SIGSTOP) through the quiet rounds."""
    torch.set_num_threads(threads)
    backend.execute(items)  # warm-up
    per_round = max(3, round(0.5 / max(1e-3, time_once(backend, items))))
    means: dict[bool, list[float]] = {False: [], True: []}
    competitor = compete.start()
    cpu = wall = 0.0
    try:
        for _ in range(repeats):
            for competing in (False, True):
                competitor.send_signal(signal.SIGCONT if competing else signal.SIGSTOP)
                cpu_before, start = cpu_seconds(competitor.pid), time.perf_counter()
                means[competing].append(statistics.fmean(time_once(backend, items) for _ in range(per_round)))
                if competing:
                    cpu, wall = cpu + cpu_seconds(competitor.pid) - cpu_before, wall + time.perf_counter() - start
        if competitor.poll() is not None:
            raise RuntimeError(f"the competing process ended early (exit {competitor.returncode})")
    finally:
        competitor.kill()
        competitor.wait()
    return Competed(statistics.median(means[False]), statistics.median(means[True]), cpu / wall)


def time_once(backend: TorchBackend, items: list[BatchItem]) -> float:
    start = time.perf_counter()
    backend.execute(items)
    return time.perf_counter() - start


def time_parts(backend: TorchBackend) -> dict[str, float]:
    """--split: timers around the model's linears (LM head included) and its attention calls, from now on; returns
    the seconds each has spent (time_threads resets them before each execute). The rest of a step is the serial part:
    the Python between the kernels, the kernels run serially at decode sizes, batch building and the sampler."""
    spent = {"linears": 0.0, "attention": 0.0}

    def timed(part: str, run: Callable[..., Any]) -> Callable[..., Any]:
        def timed_run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return timed_run

    lean = backend.model.lean
    if lean is not None:  # the layers' loop calls its linears and attention itself (model/lean_layers.py)
        lean.dense = timed("linears", lean.dense)
        lean.paged_attention = timed("attention", lean.paged_attention)
    for module in backend.model.modules():
        if isinstance(module, Linear):
            module.forward = timed("linears", module.forward)  # type: ignore[method-assign]
        ops = getattr(module, "ops", None)
        if isinstance(ops, ModelOps):
            setattr(module, "ops", replace(ops, paged_attention=timed("attention", ops.paged_attention)))  # noqa: B010
    return spent


def time_control(threads: list[int], repeats: int) -> dict[int, float]:
    """Best wall-clock seconds of a plain torch GEMM (512 x 512 @ 512 x 1536, MKL) at each thread count,
    interleaved: what the machine itself lets a second thread add at this moment (a loaded box may let it add
    nothing), beside which the forward steps' speedups are read."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(512, 512, generator=gen), torch.randn(1536, 512, generator=gen)
    best = dict.fromkeys(threads, float("inf"))
    for round_ in range(repeats + 1):
        for n in threads:
            torch.set_num_threads(n)
            start = time.perf_counter()
            for _ in range(20):
                torch.nn.functional.linear(x, w)
            if round_:
                best[n] = min(best[n], time.perf_counter() - start)
    return best


READ_BYTES = 256 << 20


def time_read_control(threads: list[int], repeats: int) -> dict[int, float]:
    """Best wall-clock seconds of one read of READ_BYTES from memory (a torch sum, too large for the caches) at each
    thread count, interleaved: the memory bandwidth a second thread adds on this machine, the ceiling of a step that
    streams its weights and K/V from memory (decode at few rows)."""
    values = torch.ones(READ_BYTES // 4)
    best = dict.fromkeys(threads, float("inf"))
    for round_ in range(repeats + 1):
        for n in threads:
            torch.set_num_threads(n)
            start = time.perf_counter()
            values.sum()
            if round_:
                best[n] = min(best[n], time.perf_counter() - start)
    return best


def serial_fraction(threads: int, speedup: float) -> float:
    """Amdahl's serial fraction s for `speedup` at `threads` threads: speedup = 1 / (s + (1 - s) / threads)."""
    return max(0.0, min(1.0, (threads / speedup - 1) / (threads - 1)))


def amdahl(fraction: float, threads: int) -> float:
    return 1 / (fraction + (1 - fraction) / threads)


def run_threads(model: Path, threads: list[int], repeats: int, split: bool = False,
                huge_pages: bool = True, kv_cache_dtype: str = "auto",
                compete: Compete | None = None) -> list[dict[str, object]]:
    shape = ModelShape.from_dir(model)
    backend = in_passing_thread(lambda: make_backends(model, [""], huge_pages, kv_cache_dtype)["default"])
    return backend.on_forward_thread(lambda: time_thread_counts(backend, shape, threads, repeats, split, compete))


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread that ends after it, and with it the OpenMP team it opened (loading, packing): the passes
    are then timed with the forward thread's team alone (TorchBackend.on_forward_thread)."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(fn()), name="create-backend")
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("creating the backend failed (its traceback is above)")
    return result[0]


def time_thread_counts(backend: TorchBackend, shape: ModelShape, threads: list[int], repeats: int,
                       split: bool, compete: Compete | None = None) -> list[dict[str, object]]:
    """run_threads' timings, on the backend's forward thread."""
    spent = time_parts(backend) if split else None
    blocks_each = NUM_BLOCKS // max(n for _, n, _ in THREAD_SHAPES)
    rows: list[dict[str, object]] = []
    controls = {"control: torch GEMM": time_control, f"control: read {READ_BYTES >> 20} MB": time_read_control}
    for kind, n, length in [*((name, 0, 0) for name in controls), *THREAD_SHAPES]:
        parts: dict[int, dict[str, float]] = {}
        if kind in controls:
            best = controls[kind](threads, repeats)
        else:
            items = step_items(kind, n, length, shape.vocab, blocks_each)
            best = time_threads(backend, kind, items, length, threads, repeats, spent, parts)
        row: dict[str, object] = {"step": kind if kind in controls else f"{kind} {n} x {length}",
                                  **{f"ms_{t}t": round(s * 1e3, 2) for t, s in best.items()}}
        for t, spent_in in parts.items():
            rest = best[t] - sum(spent_in.values())
            row |= {f"{part}_ms_{t}t": round(v * 1e3, 2) for part, v in [*spent_in.items(), ("rest", rest)]}
        top = threads[-1]
        if top > threads[0]:
            speedup = best[threads[0]] / best[top]
            fraction = serial_fraction(top // threads[0], speedup)
            row |= {f"speedup_{top}t": round(speedup, 2), "serial_fraction": round(fraction, 3),
                    "model_16t": round(amdahl(fraction, 16), 1), "model_64t": round(amdahl(fraction, 64), 1)}
        if compete is not None and kind not in controls:
            competed = time_competed(backend, items, top, repeats, compete)
            row |= {f"median_ms_{top}t": round(competed.quiet * 1e3, 2),
                    f"competed_ms_{top}t": round(competed.competed * 1e3, 2),
                    "competitor_share": round(competed.share, 3), "competed_slowdown": round(competed.slowdown, 3),
                    "amplification": round(competed.amplification(top), 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


REEXEC_ENV = "PAGEDSERVE_FORWARD_STEPS_REEXEC"


def apply_wait_policy(requested: str, spin_count: int) -> str:
    """Run this benchmark under the executor's OpenMP environment for `requested` and `spin_count` ('default':
    libgomp's own): re-execute the process with it where it differs, since this process's libgomp has read it
    already. Returns it, as text."""
    current = {k: os.environ[k] for k in OMP_VARIABLES if os.environ.get(k)}
    if requested == "default":
        wanted = {"GOMP_SPINCOUNT": str(spin_count)} if spin_count >= 0 else {}
    else:  # what the executor runs under: the environment, plus what its flags set
        wanted = current | omp_environment(requested, spin_count)
    if current != wanted and not env_switch(REEXEC_ENV, False):
        env = {k: v for k, v in os.environ.items() if k not in OMP_VARIABLES} | wanted | {REEXEC_ENV: "1"}
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.forward_steps", *sys.argv[1:]], env)
    return " ".join(f"{k}={v}" for k, v in current.items()) or "libgomp default"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_CACHE / "bench-llama-32m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--attention", default="",
                   help="comma-separated PAGEDSERVE_ATTENTION values to time side by side (e.g. cpu,reference); "
                   "empty: the executor's default")
    p.add_argument("--json-out", default=None)
    p.add_argument("--threads", default="", help="comma-separated thread counts (e.g. 1,2): time THREAD_SHAPES in "
                   "wall-clock time at each, interleaved, and print the speedup and Amdahl's serial fraction")
    p.add_argument("--split", action="store_true", help="with --threads: also time the model's linears and attention "
                   "calls inside each best step (timers around them) and print them and the rest (the serial part)")
    p.add_argument("--omp-wait-policy", default="auto", choices=["auto", "active", "passive", "default"],
                   help="as the executor's --cpu-omp-wait-policy (auto: poll 10,000 times, or the environment's "
                   "settings); default: no variables at all, libgomp's own")
    p.add_argument("--omp-spin-count", type=int, default=-1,
                   help="as the executor's --cpu-omp-spin-count (GOMP_SPINCOUNT; -1: the wait policy's)")
    p.add_argument("--no-huge-pages", action="store_true", help="as the executor's --no-cpu-huge-pages (the KV cache "
                   "in 4 KiB pages)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float16"],
                   help="as the executor's --kv-cache-dtype (with --threads)")
    p.add_argument("--compete", type=Compete.parse, default=None, metavar="BURST_MS,PERIOD_MS",
                   help="with --threads: also time each step at the top thread count while another process busy-loops "
                   "BURST_MS every PERIOD_MS, and print the slowdown and its amplification")
    args = p.parse_args(argv)
    model = ensure_model(args.model)
    if args.threads:
        policy = apply_wait_policy(args.omp_wait_policy, args.omp_spin_count)
        load = os.getloadavg()
        print(json.dumps({"omp_wait_policy": policy, "load_before": [round(x, 2) for x in load]}), flush=True)
        rows = run_threads(model, [int(t) for t in args.threads.split(",")], args.repeats, args.split,
                           not args.no_huge_pages, args.kv_cache_dtype, args.compete)
        print(json.dumps({"bench": "forward_steps_threads", "omp_wait_policy": policy, "rows": rows,
                          "load_before": [round(x, 2) for x in load],
                          "load_after": [round(x, 2) for x in os.getloadavg()]}))
        return
    torch.set_num_threads(1)
    shape = ModelShape.from_dir(model)
    limits = measure_limits(shape, 1, "cpu", clock=time.thread_time)
    backends = make_backends(model, args.attention.split(","))
    blocks_each = NUM_BLOCKS // max(n for _, n, _ in SHAPES)
    rows = []
    for kind, n, length in SHAPES:
        items = step_items(kind, n, length, shape.vocab, blocks_each)
        best = time_step(backends, kind, items, length, args.repeats)
        flops = sum(shape.pass_flops(i.start, i.num_tokens, True) for i in items)
        for name, seconds in best.items():
            row = {"step": f"{kind} {n} x {length}", "attention": name, "ms": round(seconds * 1e3, 2),
                   "gflops": round(flops / seconds / 1e9, 1),
                   "pct_of_matmul_peak": round(limits.flops_pct(flops / seconds), 1)}
            if kind == "decode":
                moved = shape.decode_step_bytes([length] * n)
                row |= {"gbs": round(moved / seconds / 1e9, 1),
                        "pct_of_read_bw": round(limits.bandwidth_pct(moved / seconds), 1)}
            if len(best) > 1:
                row["speedup_vs_last"] = round(best[list(best)[-1]] / seconds, 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {"bench": "forward_steps", "limits": limits_record(limits), "rows": rows}
    print(json.dumps(record))
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
