"""The whole stack (executor + scheduler) as processes on 127.0.0.1 for tests; process helpers live in
client/local.py."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from client.lib import PagedServeClient
from client.local import ROOT, child_pids, free_port, parse_metrics, start, status_bytes, stop, wait_healthy, wait_until

__all__ = [
    "ROOT",
    "Stack",
    "child_pids",
    "free_port",
    "generate_all",
    "parse_metrics",
    "prompts",
    "rss_bytes",
    "run",
    "running_stack",
    "start",
    "status_bytes",
    "stop",
    "thread_count",
    "wait_healthy",
    "wait_until",
]


@dataclass
class Stack:
    address: str
    executor_address: str
    metrics_port: int
    executor: subprocess.Popen[bytes]
    scheduler: subprocess.Popen[bytes]
    executor_args: list[str]
    log_dir: Path

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return parse_metrics(text)

    def idle(self) -> bool:
        """No block held and no request running, waiting or swapped, by the scheduler's metrics."""
        m = self.metrics()
        return (m["pagedserve:device_blocks_used"] == 0 and m["vllm:num_requests_running"] == 0
                and m["vllm:num_requests_waiting"] == 0 and m.get("vllm:num_requests_swapped", 0) == 0)

    def restart_executor(self) -> None:
        stop(self.executor, signal.SIGKILL)
        self.executor = start("executor_service", self.executor_args, self.log_dir / "executor.log")
        wait_healthy(self.executor_address, self.executor)


async def run_script(script: str, *args: str, timeout: float = 120) -> bytes:
    """`python -c script args...`'s standard output, run from a worker thread with subprocess: its child runs no
    Python between fork and exec. (An event loop's subprocess transport runs the interpreter's after-fork hooks
    in the child, which can crash there while gRPC threads of this process hold their locks.)"""
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script, *args], cwd=ROOT,
                                   stdout=subprocess.PIPE, timeout=timeout, check=True)
    return done.stdout


def thread_count(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def rss_bytes(proc: subprocess.Popen[bytes]) -> int:
    return status_bytes(proc.pid, "VmRSS")


@contextmanager
def running_stack(tmp_path: Path, executor_args: list[str], scheduler_args: list[str] | None = None,
                  tls_ca: str | None = None) -> Iterator[Stack]:
    ex_port, sc_port, m_port = free_port(), free_port(), free_port()
    ex_addr, sc_addr = f"127.0.0.1:{ex_port}", f"127.0.0.1:{sc_port}"
    ex_args = ["--listen", ex_addr, *executor_args]
    executor = start("executor_service", ex_args, tmp_path / "executor.log")
    scheduler = start("scheduler_service", ["--listen", sc_addr, "--executor", ex_addr, "--metrics-port",
                                            str(m_port), *(scheduler_args or [])], tmp_path / "scheduler.log")
    stack = Stack(sc_addr, ex_addr, m_port, executor, scheduler, ex_args, tmp_path)
    try:
        if tls_ca is None:
            wait_healthy(ex_addr, executor)
        wait_healthy(sc_addr, scheduler, tls_ca=tls_ca)
        yield stack
    finally:
        stop(stack.scheduler)
        stop(stack.executor)


async def run(client: PagedServeClient, **kwargs: object) -> tuple[list[int], str, int, str]:
    """One whole generation: (token ids, text, finish reason, error)."""
    ids: list[int] = []
    text, reason, error = "", 0, ""
    async for r in client.generate(**kwargs):  # type: ignore[arg-type]
        ids += r.token_ids
        text += r.text
        reason, error = r.finish_reason or reason, r.error or error
    return ids, text, reason, error


def prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 1500 for j in range(4 + i % 29)] for i in range(n)]


async def generate_all(address: str, num: int, max_tokens: int,
                       on_progress: Callable[[int], Awaitable[None]] | None = None) -> list[tuple[list[int], int]]:
    """Seeded streams (seed = index), so the simulated executor's tokens do not depend on where they ran."""
    progress = [0]

    async def one(client: PagedServeClient, i: int, prompt: list[int]) -> tuple[list[int], int]:
        ids: list[int] = []
        reason = 0
        async for r in client.generate(prompt_token_ids=prompt, max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True, seed=i):
            ids += r.token_ids
            reason = r.finish_reason or reason
            progress[0] += len(r.token_ids)
            if on_progress is not None:
                await on_progress(progress[0])
        return ids, reason

    async with PagedServeClient(address) as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts(num))))
