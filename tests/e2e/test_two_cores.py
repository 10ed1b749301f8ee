"""A front-end over two engine cores, each with its own executor (#28): requests spread over both; when one core
is SIGKILLed (and not restarted) its open requests move to the survivor at once and every stream completes with
the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
import urllib.request
from functools import partial
from pathlib import Path

from client.local import loopback, parse_metrics, start_listening, stop, wait_healthy, wait_until
from tests.support.streams import EXECUTOR, check_complete, run_all, specs

TOKENS = 120  # per stream: long enough (2.4 s of 20 ms steps) that the kill lands mid-stream on a busy machine


def core_holds_nothing(metrics_port: int) -> bool:
    """The core is up and holds no block and no request (False while its /metrics is not up yet)."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    except OSError:
        return False
    m = parse_metrics(text)
    return m.get("pagedserve:device_blocks_used", 0) == 0 and m.get("vllm:num_requests_running", 0) == 0 \
        and m.get("vllm:num_requests_waiting", 0) == 0


async def test_a_lost_core_s_requests_move_to_the_survivor_and_finish_identically(tmp_path: Path) -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cores, metrics, links = [], [], []
        for i in range(2):
            executor, ports = start_listening("executor_service", EXECUTOR, tmp_path / f"executor-{i}.log")
            procs.append(executor)
            ex = loopback(ports["listen"])
            wait_healthy(ex, executor)
            core, ports = start_listening("scheduler_service", [
                "--engine-core-listen", "tcp://127.0.0.1:0", "--api-server-count", "0", "--executor", ex,
                "--metrics-port", "0"], tmp_path / f"core-{i}.log", ("engine_core_listen", "metrics_port"))
            procs.append(core)
            cores.append(core)
            metrics.append(ports["metrics_port"])
            links += ["--engine-core", f"tcp://127.0.0.1:{ports['engine_core_listen']}"]
        frontend, ports = start_listening("scheduler_service.frontend", links, tmp_path / "frontend.log")
        procs.append(frontend)
        public = loopback(ports["listen"])
        await asyncio.to_thread(wait_healthy, public, frontend)
        for port in metrics:  # both cores ready, so that requests spread over both
            await asyncio.to_thread(wait_until, partial(core_holds_nothing, port), 30.0, "a core up")
        calls = specs(16)
        reference = await run_all(public, calls, max_tokens=TOKENS)
        check_complete(reference, calls, TOKENS)
        stamps: dict[tuple[str, int], list[float]] = {}
        begun = asyncio.Event()
        total = sum(s.n for s in calls) * TOKENS
        seen = [0]

        def count(n: int) -> None:
            seen[0] += n
            if seen[0] >= total // 8:
                begun.set()

        def stamp(key: tuple[str, int]) -> None:
            stamps.setdefault(key, []).append(time.monotonic())

        disturbed = asyncio.create_task(run_all(public, calls, count, on_response=stamp, max_tokens=TOKENS))
        await asyncio.wait_for(begun.wait(), 60)
        await asyncio.to_thread(wait_until, lambda: not core_holds_nothing(metrics[0]), 10.0, "core 0 busy")
        # (up since the loop above: False here means it holds requests)
        killed = time.monotonic()
        cores[0].send_signal(signal.SIGKILL)
        outcome = await asyncio.wait_for(disturbed, 120)
        check_complete(outcome, calls, TOKENS)
        assert outcome == reference
        log = (tmp_path / "frontend.log").read_text()
        assert "moved its" in log, log[-2000:]
        firsts = [next((t for t in s if t > killed), killed) - killed for s in stamps.values() if s[-1] > killed]
        print(f"first response after the kill, slowest stream: {max(firsts):.3f} s")
        assert max(firsts) < 5.0, max(firsts)  # the figure is 2 s; this shared machine is noisy
        await asyncio.to_thread(wait_until, lambda: core_holds_nothing(metrics[1]), 30.0, "the survivor idle")
    finally:
        for proc in reversed(procs):
            stop(proc)
