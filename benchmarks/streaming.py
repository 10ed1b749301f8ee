"""Executor busy fraction and delivered tokens/s with many streaming clients, before/after the process split.

    python benchmarks/streaming.py [--cases 256x20,1024x20,256x5] [--window 4] [--layouts before,after]
                                   [--exact 2000]

Both services run as processes; the simulated executor sleeps --sim-step-latency-ms every step (the
"x20" of a case), and this process opens N endless streams (16-token prompts, ignore_eos) over channels of
128 streams each. Once the scheduler reports N running and every stream has its second token, a window of
--window seconds is measured:

- busy: the executor's own time in its steps (StepResult.timings.total_ns, summed by the scheduler as
  pagedserve:executor_busy_seconds_total) over the window / the window: the fraction of wall time the
  executor was not waiting for the scheduler;
- simulated compute: steps in the window x the step time / the window (the part of busy spent in the
  simulated forward itself; the rest is the executor's bookkeeping and its own wake-up delays);
- delivered tok/s: tokens the clients received in the window / the window, next to the ceiling N / step;
- tokens per response: how much the front-end coalesced (a client that falls behind gets several per message);
- CPU us per delivered token of the front-end processes and of the engine core (utime+stime from /proc),
  the figure to size --api-server-count with (docs/architecture.md).

Layouts: before = `--api-server-count 0 --no-async-scheduling` (everything in one process, as before the
split), after = the defaults (one engine core process, --api-server-count front-ends, async scheduling);
`after2` = the same with two front-ends; `tier` = the engine core alone (--engine-core-listen tcp://)
with one front-end process of its own (#28). The client load runs in this process on the same cores, so
every figure includes that competition: compare the columns of one run, not runs on different days.

With --exact N, N streams are opened at once (max_tokens 50, 8 distinct prompts) against the `after`
layout and every one must finish with exactly 50 tokens, identical within each prompt group.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import uvloop

from client.bench.record import emit, machine
from client.lib import PagedServeClient
from client.local import free_port, parse_metrics, service, start, stop
from protos.pagedserve.v1 import generation_pb2

PROMPT_LEN = 16
STREAMS_PER_CHANNEL = 128
# The executor refuses steps beyond its per-step limits (Describe) and the scheduler caps its budgets to them:
# the simulated executor here allows what the scheduler flags below ask for.
BIG_STEPS = ["--max-num-seqs", "100000", "--max-num-batched-tokens", "1000000"]
LAYOUTS = {
    "before": ["--api-server-count", "0", "--no-async-scheduling"],
    "after": ["--api-server-count", "1"],
    "after2": ["--api-server-count", "2"],
    "tier": ["--api-server-count", "0"],  # the engine core alone; one front-end of its own over tcp:// (#28)
    "after-3-in-flight": ["--api-server-count", "1", "--steps-in-flight", "3"],
    "after-2-in-flight": ["--api-server-count", "1", "--steps-in-flight", "2"],
}
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def children(pid: int) -> list[int]:
    """The api server processes: children started by multiprocessing spawn (not its resource tracker)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return out


def scheduler_sample(metrics_port: int) -> tuple[float, float, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    m = parse_metrics(text)
    return (m.get("pagedserve:executor_busy_seconds_total", 0.0), m.get("pagedserve:executor_step_seconds_count", 0.0),
            m.get("vllm:num_requests_running", 0.0))


@dataclass
class Counts:
    tokens: int = 0
    responses: int = 0


async def window(address: str, metrics_port: int, core_pid: int, streams: int, seconds: float,
                 frontend_pids: list[int] | None = None) -> dict[str, float]:
    counts = Counts()
    per_stream = [0] * streams

    async def one(client: PagedServeClient, i: int) -> None:
        prompt = [65 + (i + j) % 26 for j in range(PROMPT_LEN)]
        async for r in client.generate(prompt_token_ids=prompt, max_tokens=6000, ignore_eos=True,
                                       temperature=0.0):
            n = len(r.token_ids)
            per_stream[i] += n
            counts.tokens += n
            counts.responses += 1

    def sample() -> asyncio.Future[tuple[float, float, float]]:
        return asyncio.ensure_future(asyncio.to_thread(scheduler_sample, metrics_port))

    frontends = frontend_pids if frontend_pids is not None else children(core_pid)
    clients = [PagedServeClient(address) for _ in range(-(-streams // STREAMS_PER_CHANNEL))]
    tasks = [asyncio.create_task(one(clients[i // STREAMS_PER_CHANNEL], i)) for i in range(streams)]
    deadline = time.monotonic() + 180
    try:
        while True:
            busy0, steps0, running = await sample()
            if running >= streams and min(per_stream) >= 2:
                break
            if time.monotonic() > deadline or any(t.done() for t in tasks):
                raise RuntimeError(f"only {running:.0f} of {streams} streams reached decode")
            await asyncio.sleep(0.05)
        t0, tok0, resp0 = time.perf_counter(), counts.tokens, counts.responses
        core0, fe0 = cpu_seconds(core_pid), sum(cpu_seconds(p) for p in frontends)
        await asyncio.sleep(seconds)
        busy1, steps1, _ = await sample()
        t1, tok1, resp1 = time.perf_counter(), counts.tokens, counts.responses
        core1, fe1 = cpu_seconds(core_pid), sum(cpu_seconds(p) for p in frontends)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.close()
    wall, tokens = t1 - t0, tok1 - tok0
    return {"busy": busy1 - busy0, "steps": steps1 - steps0, "wall": wall, "tokens": tokens, "responses": resp1 - resp0,
            "core_cpu": core1 - core0, "frontend_cpu": fe1 - fe0, "frontends": len(frontends)}


async def tier_window(core_args: list[str], metrics_port: int, streams: int, seconds: float) -> dict[str, float]:
    """The `tier` layout: an engine core listening on tcp:// and a front-end process of its own connected to it."""
    link = f"tcp://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="pagedserve-tier-") as logs:
        log = Path(logs) / "core.log"
        core = start("scheduler_service", ["--engine-core-listen", link, *core_args], log)
        try:
            deadline = time.monotonic() + 120
            while "engine core ready" not in log.read_text():
                if core.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine core not ready:\n{log.read_text()[-2000:]}")
                await asyncio.sleep(0.05)
            with service("scheduler_service.frontend", ["--engine-core", link], Path(logs), name="frontend") as fe:
                return await window(fe.address, metrics_port, core.pid, streams, seconds, [fe.proc.pid])
        finally:
            stop(core)


async def run_case(layout: str, streams: int, step_ms: float, seconds: float) -> dict[str, object]:
    ex_args = ["--simulated", "--num-gpu-blocks", "200000", "--sim-step-latency-ms", str(step_ms), *BIG_STEPS]
    with service("executor_service", ex_args, name="executor") as ex:
        port = free_port()
        sc_args = ["--executor", ex.address, "--metrics-port", str(port), "--max-num-seqs", "4096",
                   "--max-num-batched-tokens", "65536", "--watermark", "0", "--max-queue-len", "100000",
                   *LAYOUTS[layout]]
        if layout == "tier":
            w = await tier_window(sc_args, port, streams, seconds)
        else:
            with service("scheduler_service", sc_args, name="scheduler") as sc:
                w = await window(sc.address, port, sc.proc.pid, streams, seconds)
    step = step_ms / 1e3
    tokens = max(1.0, w["tokens"])
    return {"bench": "streaming", "layout": layout, "streams": streams, "sim_step_ms": step_ms,
            "busy": round(w["busy"] / w["wall"], 3),
            "simulated_compute": round(w["steps"] * step / w["wall"], 3),
            "delivered_tok_s": round(w["tokens"] / w["wall"]), "ceiling_tok_s": round(streams / step),
            "tokens_per_response": round(w["tokens"] / max(1.0, w["responses"]), 2),
            "core_cpu_us_per_token": round(w["core_cpu"] / tokens * 1e6, 2),
            "frontend_cpu_us_per_token": round(w["frontend_cpu"] / tokens * 1e6, 2),
            "frontend_processes": w["frontends"], "window_s": round(w["wall"], 2)}


async def exact(streams: int, layout: str, max_tokens: int = 50) -> dict[str, object]:
    ex_args = ["--simulated", "--num-gpu-blocks", "200000", "--sim-step-latency-ms", "5", *BIG_STEPS]
    log_dir = Path(os.environ.get("PAGEDSERVE_BENCH_LOGS", tempfile.mkdtemp(prefix="pagedserve-bench-")))
    with service("executor_service", ex_args, log_dir, name="executor") as ex:
        sc_args = ["--executor", ex.address, "--metrics-port", "-1", "--max-num-seqs", "4096",
                   "--max-num-batched-tokens", "65536", "--watermark", "0", "--max-queue-len", "100000",
                   *LAYOUTS[layout]]
        with service("scheduler_service", sc_args, log_dir, name="scheduler") as sc:
            clients = [PagedServeClient(sc.address) for _ in range(-(-streams // STREAMS_PER_CHANNEL))]

            async def one(i: int) -> tuple[int, list[int], int]:
                ids: list[int] = []
                reason = 0
                prompt = [65 + (i % 8 + j) % 26 for j in range(PROMPT_LEN)]
                async for r in clients[i // STREAMS_PER_CHANNEL].generate(
                        prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.7,
                        seed=1000 + i % 8, timeout=300):
                    ids += r.token_ids
                    reason = r.finish_reason or reason
                return i % 8, ids, reason

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(i) for i in range(streams)), return_exceptions=True)
            wall = time.perf_counter() - t0
            for client in clients:
                await client.close()
    failed = [r for r in results if isinstance(r, BaseException)]
    done = [r for r in results if not isinstance(r, BaseException)]
    groups: dict[int, set[tuple[int, ...]]] = {}
    for group, ids, _ in done:
        groups.setdefault(group, set()).add(tuple(ids))
    complete = sum(1 for _, ids, reason in done
                   if len(ids) == max_tokens and reason == generation_pb2.FINISH_REASON_LENGTH)
    return {"bench": "streaming", "layout": layout, "exact_streams": streams, "completed_exactly": complete,
            "identical_within_prompt": all(len(v) == 1 for v in groups.values()), "errors": len(failed),
            "first_error": repr(failed[0]) if failed else "", "wall_s": round(wall, 2),
            "all_exact": complete == streams and all(len(v) == 1 for v in groups.values())}


async def run_all(args: argparse.Namespace) -> None:
    emit({"bench": "streaming", "machine": machine()})
    rows: list[dict[str, object]] = []
    for case in filter(None, args.cases.split(",")):
        streams, step_ms = case.split("x")
        for layout in args.layouts.split(","):
            rec = await run_case(layout, int(streams), float(step_ms), args.window)
            emit(rec)
            rows.append(rec)
    if rows:
        print_table(rows)
    if args.exact:
        emit(await exact(args.exact, args.exact_layout))
    emit({"bench": "streaming", "machine_after": machine()})


def print_table(rows: list[dict[str, object]]) -> None:
    print("| streams | step | layout | executor busy (simulated compute) | delivered tok/s (ceiling) | "
          "tokens/response | front-end CPU us/token | core CPU us/token |\n" + "| --- " * 8 + "|")
    for r in rows:
        print(f"| {r['streams']} | {r['sim_step_ms']:g} ms | {r['layout']} | {float(r['busy']) * 100:.0f}% "  # type: ignore[arg-type]
              f"({float(r['simulated_compute']) * 100:.0f}%) | "  # type: ignore[arg-type]
              f"{r['delivered_tok_s']} ({r['ceiling_tok_s']}) | {r['tokens_per_response']} | "
              f"{r['frontend_cpu_us_per_token']} | {r['core_cpu_us_per_token']} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="256x20,1024x20,256x5", help="STREAMSxSTEP_MS, comma-separated")
    p.add_argument("--layouts", default="before,after", help=f"comma-separated, of {sorted(LAYOUTS)}")
    p.add_argument("--window", type=float, default=4.0, help="seconds measured per case")
    p.add_argument("--exact", type=int, default=0, help="also open this many streams at once and check them")
    p.add_argument("--exact-layout", default="after", help="the layout --exact runs against")
    uvloop.run(run_all(p.parse_args(argv)))


if __name__ == "__main__":
    main()
