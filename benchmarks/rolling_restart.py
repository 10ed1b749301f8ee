"""Every tier restarted in turn under streaming load (#28): a simulated executor, an engine core listening for
front-ends, two front-ends on one port; client-library streams (gRPC, resuming) and OpenAI HTTP SSE streams run
while each kind of restart happens in turn: front-end SIGTERM, front-end SIGKILL, engine core SIGKILL, engine
core SIGTERM, executor SIGKILL (each restarted at once). Reports failed streams per transport, the longest gap a
stream saw across each restart (the response before it to the one after), and tokens the front-ends re-submitted.
Each of --streams workers runs one stream after another until the last restart has settled, so every restart
happens with --streams streams open.

    python -m benchmarks.rolling_restart [--streams 256] [--http-streams 16] [--max-tokens 400] [--step-ms 10]

HTTP clients cannot resume: a front-end SIGKILL ends theirs (expected; SIGTERM drains them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import aiohttp

from client.lib import PagedServeClient
from client.local import free_port, start, stop, wait_healthy

KINDS = ("frontend SIGTERM", "frontend SIGKILL", "core SIGKILL", "core SIGTERM", "executor SIGKILL")


@dataclass
class Stack:
    logs: Path
    step_ms: int
    executor_address: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    core_address: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_port()}")
    public: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    http: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    frontends: list[subprocess.Popen[bytes]] = field(default_factory=list)
    starts: int = 0

    def _start(self, role: str, module: str, args: list[str]) -> subprocess.Popen[bytes]:
        self.starts += 1
        proc = start(module, args, self.logs / f"{role}-{self.starts}.log")
        self.procs[f"{role}-{self.starts}"] = proc
        return proc

    def executor(self) -> subprocess.Popen[bytes]:
        proc = self._start("executor", "executor_service", ["--listen", self.executor_address, "--simulated",
                                                            "--sim-step-latency-ms", str(self.step_ms)])
        wait_healthy(self.executor_address, proc)
        return proc

    def core(self) -> subprocess.Popen[bytes]:
        """An engine core, once it says it is ready (its executor connected)."""
        proc = self._start("core", "scheduler_service", ["--engine-core-listen", self.core_address,
                                                         "--api-server-count", "0", "--executor",
                                                         self.executor_address, "--metrics-port", "-1",
                                                         "--engine-core-timeout", "3"])
        log = self.logs / f"core-{self.starts}.log"
        deadline = time.monotonic() + 60
        while "engine core ready" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine core not ready: see {log}")
            time.sleep(0.05)
        return proc

    def frontend(self) -> subprocess.Popen[bytes]:
        proc = self._start("frontend", "scheduler_service.frontend", ["--engine-core", self.core_address,
                                                                      "--listen", self.public, "--http-listen",
                                                                      self.http])
        self.frontends.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs.values():
            stop(proc)

    def resubmitted_tokens(self) -> int:
        pattern = re.compile(r"\((\d+) tokens to recompute")
        return sum(int(m) for log in self.logs.glob("frontend-*.log") for m in pattern.findall(log.read_text()))


@dataclass
class Load:
    stamps: list[list[float]] = field(default_factory=list)  # per stream: when each response came
    failed: dict[str, int] = field(default_factory=lambda: {"grpc": 0, "http": 0})
    restarts: list[tuple[float, str]] = field(default_factory=list)  # (when, kind), in order
    refused_http: int = 0  # 503 before a stream began (a draining or not-ready front-end): the client retries
    errors: list[str] = field(default_factory=list)
    done: dict[str, int] = field(default_factory=lambda: {"grpc": 0, "http": 0})


    def last_restart(self) -> str:
        return self.restarts[-1][1] if self.restarts else "no restart"


async def grpc_stream(client: PagedServeClient, i: int, max_tokens: int, load: Load) -> None:
    stamps: list[float] = []
    load.stamps.append(stamps)
    try:
        n = 0
        async for r in client.generate(prompt_token_ids=[3 + (i * 7 + j) % 1000 for j in range(16 + i % 32)],
                                       max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=i):
            stamps.append(time.monotonic())
            n += len(r.token_ids)
        if n != max_tokens:
            raise RuntimeError(f"{n} tokens of {max_tokens} (stream {i}, resumed {client.num_resumed} so far)")
        load.done["grpc"] += 1
    except Exception as e:
        load.failed["grpc"] += 1
        load.errors.append(f"grpc after {load.last_restart()}: {e!r}"[:600])


async def http_stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int, load: Load) -> None:
    stamps: list[float] = []
    load.stamps.append(stamps)
    body = {"prompt": [5 + i, 6, 7, 8], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        reason = None
        async with session.post(url, json=body) as response:
            if response.status == 503:
                load.refused_http += 1
                await asyncio.sleep(0.2)  # as a client would before trying again
                return
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:120]}")
            async for line in response.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    stamps.append(time.monotonic())
                    reason = json.loads(text[6:])["choices"][0].get("finish_reason") or reason
        if reason != "length":
            raise RuntimeError(f"finish_reason {reason}")
        load.done["http"] += 1
    except aiohttp.ClientConnectorError:  # no stream began: a port closing under it (SO_REUSEPORT); retried
        load.refused_http += 1
        await asyncio.sleep(0.2)
    except Exception as e:
        load.failed["http"] += 1
        load.errors.append(f"http after {load.last_restart()}: {e!r}"[:200])


def longest_gap(stamps: list[list[float]], start: float, end: float) -> float:
    """The longest time a stream waited between two responses while a restart was under way (from its signal
    to `end`: the replacement up, plus the settling time)."""
    gaps = [0.0]
    for s in stamps:
        gaps.extend(b - a for a, b in pairwise(s) if b > start and a < end)
    return max(gaps)


async def restart(stack: Stack, kind: str) -> None:
    if kind.startswith("frontend"):
        old = stack.frontends.pop(0)
        new = stack.frontend()  # the replacement first, as a rolling update does
        await asyncio.to_thread(wait_healthy, stack.public, new)
        await asyncio.to_thread(stop, old, signal.SIGKILL if kind.endswith("SIGKILL") else signal.SIGTERM)
        return
    role = "core" if kind.startswith("core") else "executor"
    old = next(p for name, p in reversed(stack.procs.items()) if name.startswith(role))
    await asyncio.to_thread(stop, old, signal.SIGKILL if kind.endswith("SIGKILL") else signal.SIGTERM)
    starter: Callable[[], subprocess.Popen[bytes]] = stack.core if role == "core" else stack.executor
    await asyncio.to_thread(starter)


async def run(args: argparse.Namespace, logs: Path) -> dict[str, object]:
    stack = Stack(logs, args.step_ms)
    try:
        stack.executor()
        stack.core()
        for _ in range(2):
            await asyncio.to_thread(wait_healthy, stack.public, stack.frontend())
        load = Load()
        client = PagedServeClient(stack.public, resume_attempts=10)
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        over = asyncio.Event()
        url = f"http://{stack.http}/v1/completions"

        async def grpc_worker(i: int) -> None:
            while not over.is_set():
                await grpc_stream(client, i, args.max_tokens, load)

        async def http_worker(i: int) -> None:
            while not over.is_set():
                failed = load.failed["http"]
                await http_stream(session, url, i, args.max_tokens, load)
                if load.failed["http"] > failed:
                    await asyncio.sleep(0.5)  # as a client would before trying again

        tasks = [asyncio.create_task(grpc_worker(i)) for i in range(args.streams)]
        tasks += [asyncio.create_task(http_worker(i)) for i in range(args.http_streams)]
        await asyncio.sleep(args.settle)
        moments: dict[str, tuple[float, float]] = {}
        for kind in KINDS:
            began = time.monotonic()
            load.restarts.append((began, kind))
            await restart(stack, kind)
            await asyncio.sleep(args.settle)
            moments[kind] = (began, time.monotonic())
        over.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 600)
        await session.close()
        await client.close()
        return {"open_streams": {"grpc": args.streams, "http": args.http_streams}, "completed": load.done,
                "failed": load.failed, "http_refused_then_retried": load.refused_http,
                "errors": sorted(set(load.errors))[:20],
                "longest_gap_s": {k: round(longest_gap(load.stamps, *w), 3) for k, w in moments.items()},
                "tokens_resubmitted_by_frontends": stack.resubmitted_tokens()}
    finally:
        stack.stop_all()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256, help="client-library (gRPC) streams")
    p.add_argument("--http-streams", type=int, default=16, help="OpenAI HTTP SSE streams")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--step-ms", type=int, default=10, help="the simulated executor's step latency")
    p.add_argument("--settle", type=float, default=1.5, help="seconds of load before and after each restart")
    p.add_argument("--logs", default=None, help="directory for the processes' logs (default: a temporary one)")
    args = p.parse_args()
    if args.logs:
        Path(args.logs).mkdir(parents=True, exist_ok=True)
        print(json.dumps(asyncio.run(run(args, Path(args.logs))), indent=2))
        return
    with tempfile.TemporaryDirectory(prefix="rolling-") as logs:
        print(json.dumps(asyncio.run(run(args, Path(logs))), indent=2))


if __name__ == "__main__":
    main()
