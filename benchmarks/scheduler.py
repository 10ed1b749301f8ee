"""Scheduler core micro-benchmark: the cost of one schedule() + update() with N running decodes.

    python benchmarks/scheduler.py --running 1024 --waiting 100000 [--steps 2000]

An in-process fake executor answers each step with one token per scheduled decode (no I/O, not
timed). W waiting requests sit behind max_num_seqs == N, so they are never admitted: their cost
must not show in the step time (the hot loop is O(running), never O(waiting) or O(blocks)).
Prints one JSON line: running, waiting, steps, p50_us, p99_us, mean_us (schedule + update per step),
and the two halves' medians.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from client.bench.stats import percentile
from scheduler_service.core.config import CoreConfig, ModelLimits
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

BLOCK_SIZE = 16
PROMPT_LEN = 32
TOKEN = 42
EOS = 2


def fake_execute(out: SchedulerOutput) -> ExecutorResult:
    """One token for every request whose scheduled tokens complete its known tokens."""
    sampled = {}
    for work in out.scheduled:
        req = work.request
        if req.num_computed_tokens + work.num_tokens >= req.num_tokens:
            sampled[req.request_id] = [TOKEN] * out.num_steps
    return ExecutorResult(sampled=sampled)


def build(running: int, waiting: int, steps: int, warmup: int) -> Scheduler:
    tokens_per_request = PROMPT_LEN + warmup + steps + 16
    blocks_per_request = -(-tokens_per_request // BLOCK_SIZE)
    num_blocks = running * blocks_per_request + 64
    config = CoreConfig(max_num_seqs=running, max_num_batched_tokens=max(2048, running * PROMPT_LEN),
                        watermark=0.0)
    limits = ModelLimits(block_size=BLOCK_SIZE, num_device_blocks=num_blocks, num_cpu_blocks=0,
                         max_model_len=tokens_per_request + 1024, eos_token_ids=(EOS,))
    scheduler = Scheduler(config, limits)
    options = SamplingOptions(max_tokens=10**9, ignore_eos=True)
    now = time.monotonic()
    for i in range(running):
        scheduler.add_request(Request(f"run-{i}", [7] * PROMPT_LEN, options, now))
    # First step: every prompt is prefilled; afterwards every running request is a one-token decode
    # (its one uncomputed token is the one sampled last step).
    out = scheduler.schedule()
    scheduler.update(out, fake_execute(out))
    assert len(scheduler.running) == running, "not every request was admitted"
    assert all(r.status is RequestStatus.RUNNING and r.num_tokens - r.num_computed_tokens == 1
               for r in scheduler.running)
    for i in range(waiting):
        scheduler.add_request(Request(f"wait-{i}", [7] * PROMPT_LEN, options, now))
    return scheduler


def run(running: int, waiting: int, steps: int, warmup: int, freeze: bool = True) -> dict[str, object]:
    scheduler = build(running, waiting, steps, warmup)
    gc.collect()
    if freeze:
        gc.freeze()
        gc.set_threshold(20_000, 50, 1000)
    perf = time.perf_counter_ns
    schedule, update = scheduler.schedule, scheduler.update
    sched_ns: list[int] = []
    upd_ns: list[int] = []
    for step in range(warmup + steps):
        t0 = perf()
        out = schedule()
        t1 = perf()
        result = fake_execute(out)
        t2 = perf()
        update(out, result)
        t3 = perf()
        if step >= warmup:
            sched_ns.append(t1 - t0)
            upd_ns.append(t3 - t2)
        assert len(out.scheduled) == running and not out.new_requests(), "the benchmark's shape broke"
    assert len(scheduler.waiting) == waiting
    total = sorted((a + b) / 1e3 for a, b in zip(sched_ns, upd_ns, strict=True))
    return {
        "running": running, "waiting": waiting, "steps": steps,
        "p50_us": round(percentile(total, 0.50), 1), "p99_us": round(percentile(total, 0.99), 1),
        "mean_us": round(statistics.fmean(total), 1),
        "schedule_p50_us": round(percentile(sorted(x / 1e3 for x in sched_ns), 0.50), 1),
        "update_p50_us": round(percentile(sorted(x / 1e3 for x in upd_ns), 0.50), 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, default=256, help="running decodes (max_num_seqs is set to this)")
    p.add_argument("--waiting", type=int, default=0, help="waiting requests that can never be admitted")
    p.add_argument("--steps", type=int, default=2000, help="timed steps")
    p.add_argument("--warmup", type=int, default=100, help="untimed steps first")
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the garbage collector as Python starts it (the services freeze start-up objects)")
    p.add_argument("--profile", metavar="FILE", default=None, help="write a cProfile of the timed loop to FILE")
    args = p.parse_args(argv)
    if args.running < 1:
        p.error("--running must be at least 1")
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        result = profiler.runcall(run, args.running, args.waiting, args.steps, args.warmup, not args.no_gc_freeze)
        profiler.dump_stats(args.profile)
    else:
        result = run(args.running, args.waiting, args.steps, args.warmup, not args.no_gc_freeze)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
