"""Scheduler core micro-benchmark: the cost of one schedule() + update() with N running decodes,
beside nano-vllm's scheduler doing the same in the same process.

    python benchmarks/scheduler.py --running 1024 --waiting 100000 [--steps 2000] \
        [--nano-vllm /tmp/nano-vllm]

An in-process fake executor answers each step with one token per scheduled decode (no I/O, not
timed). W waiting requests sit behind max_num_seqs == N, so they are never admitted: their cost
must not show in the step time (the hot loop is O(running), never O(waiting) or O(blocks)).
Prefix caching is on (the default), as is nano-vllm's.

--nano-vllm names a checkout of https://github.com/GeeeekExplorer/nano-vllm (not vendored); its
Scheduler, BlockManager and Sequence are imported alone (stubbing its Config, which needs
transformers, and xxhash when absent) and timed for schedule() + postprocess() on the same
N running decodes with the same block size, interleaved with ours in rounds. nano-vllm has no
max_num_seqs cap on admission from a non-empty running set, so its run has no waiting requests.
Prints one JSON line: running, waiting, steps, p50_us, p99_us, mean_us (schedule + update per step),
the two halves' medians, and with the peer nano_vllm_p50_us and ratio_p50 (ours / nano-vllm's).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import json
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from client.bench.stats import percentile
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 32


def prompt(i: int) -> list[int]:
    """Prompt lengths PROMPT_LEN .. PROMPT_LEN + BLOCK_SIZE - 1, so every step some requests fill a block
    (the real mix: not all of them at once every BLOCK_SIZE steps)."""
    return [7] * (PROMPT_LEN + i % BLOCK_SIZE)
TOKEN = 42
EOS = 2


def fake_execute(out: SchedulerOutput) -> ExecutorResult:
    """One token (num_steps tokens) for every request whose scheduled tokens complete its known tokens,
    in the step's order, in the shape the executor client builds from the wire (columns for one token)."""
    done = [w.request.request_id for w in out.scheduled
            if w.request.num_computed_tokens + w.num_tokens >= w.request.num_tokens]
    if out.num_steps == 1:
        return ExecutorResult(ids=done, tokens=[TOKEN] * len(done))
    return ExecutorResult(sampled={rid: [TOKEN] * out.num_steps for rid in done})


def build(running: int, waiting: int, steps: int, warmup: int, async_scheduling: bool = False) -> Scheduler:
    tokens_per_request = PROMPT_LEN + BLOCK_SIZE + warmup + steps + 16
    blocks_per_request = -(-tokens_per_request // BLOCK_SIZE)
    num_blocks = running * blocks_per_request + 64
    config = CoreConfig(max_num_seqs=running, max_num_batched_tokens=max(2048, running * (PROMPT_LEN + BLOCK_SIZE)),
                        watermark=0.0, async_scheduling=async_scheduling)
    limits = ExecutorLimits(block_size=BLOCK_SIZE, num_device_blocks=num_blocks, num_swap_blocks=0,
                         max_model_len=tokens_per_request + 1024, eos_token_ids=(EOS,))
    scheduler = Scheduler(config, limits)
    options = SamplingOptions(max_tokens=10**9, ignore_eos=True)
    now = time.monotonic()
    for i in range(running):
        scheduler.add_request(Request(f"run-{i}", prompt(i), options, now))
    # First step: every prompt is prefilled; afterwards every running request is a one-token decode
    # (its one uncomputed token is the one sampled last step).
    out = scheduler.schedule()
    scheduler.update(out, fake_execute(out))
    assert len(scheduler.running) == running, "not every request was admitted"
    assert all(r.status is RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
               for r in scheduler.running)
    for i in range(waiting):
        scheduler.add_request(Request(f"wait-{i}", prompt(i), options, now))
    return scheduler


def ours(running: int, waiting: int, steps: int, warmup: int,
         async_scheduling: bool = False) -> Callable[[], tuple[int, int]]:
    """One timed step of our scheduler per call: (schedule ns, update ns). With async scheduling each
    call schedules step k + 1 while step k is in flight, then updates step k (the engine's order)."""
    scheduler = build(running, waiting, steps, warmup, async_scheduling)
    perf = time.perf_counter_ns
    schedule, update = scheduler.schedule, scheduler.update
    if async_scheduling:
        first = schedule()
        in_flight = [(first, fake_execute(first))]

        def step_ahead() -> tuple[int, int]:
            t0 = perf()
            out = schedule()
            t1 = perf()
            in_flight.append((out, fake_execute(out)))
            t2 = perf()
            update(*in_flight.pop(0))
            t3 = perf()
            assert len(out.scheduled) == running and not out.new_requests(), "the benchmark's shape broke"
            return t1 - t0, t3 - t2
        return step_ahead

    def step() -> tuple[int, int]:
        t0 = perf()
        out = schedule()
        t1 = perf()
        result = fake_execute(out)
        t2 = perf()
        update(out, result)
        t3 = perf()
        assert len(out.scheduled) == running and not out.new_requests(), "the benchmark's shape broke"
        return t1 - t0, t3 - t2
    return step


class _Xxh64:
    """Stand-in for xxhash.xxh64 where xxhash is not installed (nano-vllm hashes each full block)."""

    def __init__(self) -> None:
        self._h = hashlib.blake2b(digest_size=8)

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def intdigest(self) -> int:
        return int.from_bytes(self._h.digest(), "little")


@dataclass
class _NanoConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    eos: int
    kvcache_block_size: int
    num_kvcache_blocks: int


def import_nano(path: Path) -> dict[str, Any] | None:
    """nano-vllm's scheduler modules from a checkout, without its package __init__ (torch, transformers)."""
    root = path / "nanovllm"
    if not (root / "engine" / "scheduler.py").is_file():
        return None
    for name, where in (("nanovllm", root), ("nanovllm.engine", root / "engine")):
        package = types.ModuleType(name)
        package.__path__ = [str(where)]
        sys.modules[name] = package
    config = types.ModuleType("nanovllm.config")
    config.Config = _NanoConfig  # type: ignore[attr-defined]
    sys.modules["nanovllm.config"] = config
    try:
        importlib.import_module("xxhash")
    except ImportError:
        sys.modules["xxhash"] = types.SimpleNamespace(xxh64=_Xxh64)  # type: ignore[assignment]
    return {name: importlib.import_module(f"nanovllm.{name}")
            for name in ("sampling_params", "engine.sequence", "engine.scheduler")}


def nano(modules: dict[str, Any], running: int, steps: int, warmup: int) -> Callable[[], tuple[int, int]]:
    Sequence = modules["engine.sequence"].Sequence
    Sequence.block_size = BLOCK_SIZE
    tokens_per_request = PROMPT_LEN + BLOCK_SIZE + 2 * (warmup + steps) + 16
    num_blocks = running * -(-tokens_per_request // BLOCK_SIZE) + 64
    config = _NanoConfig(running, max(2048, running * (PROMPT_LEN + BLOCK_SIZE)), EOS, BLOCK_SIZE, num_blocks)
    scheduler = modules["engine.scheduler"].Scheduler(config)
    params = modules["sampling_params"].SamplingParams(temperature=1.0, max_tokens=10**9, ignore_eos=True)
    for i in range(running):
        scheduler.add(Sequence(prompt(i), params))
    seqs, prefill = scheduler.schedule()
    scheduler.postprocess(seqs, [TOKEN] * len(seqs), prefill)
    assert len(scheduler.running) == running and not scheduler.waiting
    perf = time.perf_counter_ns
    tokens = [TOKEN] * running

    def step() -> tuple[int, int]:
        t0 = perf()
        seqs, prefill = scheduler.schedule()
        t1 = perf()
        t2 = perf()
        scheduler.postprocess(seqs, tokens, prefill)
        t3 = perf()
        assert len(seqs) == running and not prefill, "the peer's shape broke"
        return t1 - t0, t3 - t2
    return step


def summary(times: list[tuple[int, int]]) -> dict[str, float]:
    total = sorted((a + b) / 1e3 for a, b in times)
    return {
        "p50_us": round(percentile(total, 0.50), 1), "p99_us": round(percentile(total, 0.99), 1),
        "mean_us": round(statistics.fmean(total), 1),
        "schedule_p50_us": round(percentile(sorted(a / 1e3 for a, _ in times), 0.50), 1),
        "update_p50_us": round(percentile(sorted(b / 1e3 for _, b in times), 0.50), 1),
    }


def run(running: int, waiting: int, steps: int, warmup: int, freeze: bool = True,
        nano_path: Path | None = None, async_scheduling: bool = False) -> dict[str, object]:
    """Both schedulers step in alternating rounds of 50, so machine load falls on both alike."""
    contenders = {"ours": ours(running, waiting, steps, warmup, async_scheduling)}
    modules = import_nano(nano_path) if nano_path is not None else None
    if modules is not None:
        contenders["nano"] = nano(modules, running, steps, warmup)
    gc.collect()
    if freeze:
        gc.freeze()
        gc.set_threshold(20_000, 50, 1000)
    times: dict[str, list[tuple[int, int]]] = {name: [] for name in contenders}
    done = 0
    while done < warmup + steps:
        rounds = min(50, warmup + steps - done)
        for name, step in contenders.items():
            for i in range(rounds):
                t = step()
                if done + i >= warmup:
                    times[name].append(t)
        done += rounds
    result: dict[str, object] = {"running": running, "waiting": waiting, "steps": steps,
                                 "async_scheduling": async_scheduling, **summary(times["ours"])}
    if "nano" in times:
        peer = summary(times["nano"])
        result["nano_vllm_p50_us"] = peer["p50_us"]
        result["nano_vllm_p99_us"] = peer["p99_us"]
        result["nano_vllm_mean_us"] = peer["mean_us"]
        result["nano_vllm_schedule_p50_us"] = peer["schedule_p50_us"]
        result["nano_vllm_update_p50_us"] = peer["update_p50_us"]
        result["ratio_p50"] = round(float(result["p50_us"]) / peer["p50_us"], 2)  # type: ignore[arg-type]
    elif nano_path is not None:
        result["nano_vllm"] = f"skipped: no nano-vllm sources at {nano_path}"
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256, help="running decodes (max_num_seqs is set to this)")
    p.add_argument("--waiting", type=int, default=0, help="waiting requests that can never be admitted")
    p.add_argument("--steps", type=int, default=2000, help="timed steps")
    p.add_argument("--warmup", type=int, default=100, help="untimed steps first")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the garbage collector as Python starts it (the services freeze start-up objects)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="schedule each step while the one before is in flight (the service's default)")
    p.add_argument("--profile", metavar="FILE", default=None, help="write a cProfile of the timed loop to FILE")
    p.add_argument("--nano-vllm", metavar="PATH", type=Path, default=None,
                   help="a nano-vllm checkout to time beside ours (skipped when absent)")
    args = p.parse_args(argv)
    if args.running < 1:
        p.error("--running must be at least 1")
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(run, args.running, args.waiting, args.steps, args.warmup, not args.no_gc_freeze,
                                  None, args.async_scheduling)
        profiler.dump_stats(args.profile)
    else:
        result = run(args.running, args.waiting, args.steps, args.warmup, not args.no_gc_freeze, args.nano_vllm,
                     args.async_scheduling)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
