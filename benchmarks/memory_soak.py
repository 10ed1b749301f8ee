"""Memory soak: N requests through real processes, the RSS of every process sampled as they go.

    python -m benchmarks.memory_soak [--requests 100000] [--concurrency 4] [--samples 10] [--warmup-samples 2]
        [--api-server-count 2] [--prompt-len 40] [--max-tokens 8] [--json-out FILE]

Starts the simulated executor (no model, zero step latency) and the scheduler service (engine core and
--api-server-count api server processes, /metrics on), then sends --requests gRPC Generate calls from
--concurrency clients, each on a connection of its own (the kernel spreads them over the api servers), one call
at a time per client. Every prompt is new (--prompt-len tokens, two full blocks of its own and a shared first
block), so the prefix cache registers, hits and evicts blocks all along; each call asks for --max-tokens tokens
(ignore_eos). /metrics is scraped at every sample, as a Prometheus server would.

Every requests / samples calls it reads VmRSS (and RssAnon) from /proc of each process: the engine core, each of
its children (the api servers), and the executor. After --warmup-samples samples (the collectors' thresholds
and the allocators' arenas fill first), the growth of each process per window is divided by the calls in the
window; a leak grows in every window, so the median window tells a leak from the odd one-time step (an arena
taken). Prints one JSON line per sample and a summary line per process: RSS after warm-up and at the end,
growth per request (median of the windows, and end minus warm-up over the calls between), and a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from client.bench.record import emit, machine
from client.lib import build_request
from client.local import child_pids, free_port, service, status_bytes
from protos.pagedserve.v1 import generation_pb2_grpc
from protos.wire import GRPC_OPTIONS, open_channel


@dataclass
class Process:
    name: str
    pid: int
    rss: list[int] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)


def processes(core: int, executor: int) -> list[Process]:
    found = [Process("engine core", core)]
    found += [Process(f"{kind} {i}", pid) for i, (pid, kind) in enumerate(child_pids(core).items())]
    found.append(Process("executor", executor))
    return found


def prompt(i: int, length: int) -> list[int]:
    """A first block every prompt shares, then tokens of this call's own."""
    shared = [5 + j for j in range(16)]
    return (shared + [100 + (i * 7919 + j * 31) % 30000 for j in range(length)])[:length]


async def soak(address: str, metrics_port: int, procs: list[Process], args: argparse.Namespace) -> list[float]:
    every = max(1, args.requests // args.samples)
    marks = [0]
    done = 0
    next_sample = every
    started = time.monotonic()
    lock = asyncio.Lock()

    def sample() -> None:
        urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        for p in procs:
            p.rss.append(status_bytes(p.pid, "VmRSS"))
            p.anon.append(status_bytes(p.pid, "RssAnon"))
        record = {"part": "sample", "requests": done, "elapsed_s": round(time.monotonic() - started, 1),
                  **{p.name: p.rss[-1] for p in procs}}
        emit(record, args.json_out)

    sample()
    counter = iter(range(args.requests))

    async def client() -> None:
        nonlocal done, next_sample
        # a subchannel (TCP connection) of its own: channels in one process otherwise share one
        async with open_channel(address, None, [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            for i in counter:
                tokens = 0
                request = build_request(prompt_token_ids=prompt(i, args.prompt_len), max_tokens=args.max_tokens,
                                        ignore_eos=True, temperature=0.0)
                async for r in stub.Generate(request, timeout=60):
                    tokens += len(r.token_ids)
                if tokens != args.max_tokens:
                    raise RuntimeError(f"call {i} returned {tokens} tokens, not {args.max_tokens}")
                async with lock:
                    done += 1
                    if done >= next_sample:
                        marks.append(done)
                        next_sample += every
                        sample()

    await asyncio.gather(*(client() for _ in range(args.concurrency)))
    if marks[-1] != done:
        marks.append(done)
        sample()
    return [float(m) for m in marks]


def summary(p: Process, marks: list[float], warmup: int) -> dict[str, object]:
    w = min(warmup, len(marks) - 2)
    windows = [(p.rss[k + 1] - p.rss[k]) / (marks[k + 1] - marks[k]) for k in range(w, len(marks) - 1)
               if marks[k + 1] > marks[k]]
    anon_windows = [(p.anon[k + 1] - p.anon[k]) / (marks[k + 1] - marks[k]) for k in range(w, len(marks) - 1)
                    if marks[k + 1] > marks[k]]
    calls = marks[-1] - marks[w]
    return {"part": "process", "process": p.name, "start_mb": round(p.rss[0] / 1e6, 1),
            "after_warmup_mb": round(p.rss[w] / 1e6, 1), "end_mb": round(p.rss[-1] / 1e6, 1),
            "peak_mb": round(max(p.rss) / 1e6, 1), "warmup_requests": int(marks[w]),
            "bytes_per_request_median_window": round(statistics.median(windows), 1) if windows else None,
            "bytes_per_request_overall": round((p.rss[-1] - p.rss[w]) / calls, 1) if calls else None,
            "anon_bytes_per_request_median_window": round(statistics.median(anon_windows), 1) if anon_windows
            else None,
            "windows_growing": sum(1 for x in windows if x > 0), "windows": len(windows)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=4, help="clients, each on its own connection, one call at a time")
    p.add_argument("--samples", type=int, default=10, help="RSS samples after the first (every requests / samples)")
    p.add_argument("--warmup-samples", type=int, default=2, help="samples before the growth is counted")
    p.add_argument("--api-server-count", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--scheduler-arg", action="append", default=[], help="one more scheduler flag (repeatable)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.requests < args.samples or args.samples < 2 or args.concurrency < 1:
        p.error("need --requests >= --samples >= 2 and --concurrency >= 1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    metrics_port = free_port()
    with service("executor_service", ["--simulated"], name="executor") as executor:
        sched_args = ["--executor", executor.address, "--metrics-port", str(metrics_port),
                      "--api-server-count", str(args.api_server_count), *args.scheduler_arg]
        with service("scheduler_service", sched_args, name="scheduler") as scheduler:
            procs = processes(scheduler.proc.pid, executor.proc.pid)
            print(f"processes: {[(x.name, x.pid) for x in procs]}", file=sys.stderr, flush=True)
            started = time.monotonic()
            marks = asyncio.run(soak(scheduler.address, metrics_port, procs, args))
            elapsed = time.monotonic() - started
    rows = [summary(x, marks, args.warmup_samples) for x in procs]
    head = {"part": "soak", "requests": args.requests, "concurrency": args.concurrency,
            "api_server_count": args.api_server_count, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "elapsed_s": round(elapsed, 1), "requests_per_s": round(args.requests / elapsed, 1), "machine": machine()}
    emit(head, args.json_out)
    for row in rows:
        emit(row, args.json_out)
    print("\n| process | RSS start (MB) | after warm-up | end | peak | B/request, median window | B/request, overall "
          "| windows growing |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['process']} | {row['start_mb']} | {row['after_warmup_mb']} | {row['end_mb']} | {row['peak_mb']} "
              f"| {row['bytes_per_request_median_window']} | {row['bytes_per_request_overall']} "
              f"| {row['windows_growing']} / {row['windows']} |")


if __name__ == "__main__":
    main()
