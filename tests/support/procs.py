"""The whole stack (executor + scheduler) as processes on 127.0.0.1 for tests; process helpers live in
client/local.py."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from client.lib import PagedServeClient
from client.local import (
    ROOT,
    child_pids,
    free_port,
    loopback,
    parse_metrics,
    port_file_of,
    start,
    start_listening,
    status_bytes,
    stop,
    wait_healthy,
    wait_until,
)
from client.port_file import wait_ports

__all__ = [
    "ROOT",
    "Stack",
    "child_pids",
    "free_port",
    "generate_all",
    "loopback",
    "parse_metrics",
    "port_file_of",
    "prompts",
    "refusing_address",
    "rss_bytes",
    "run",
    "running_http_stack",
    "running_stack",
    "start",
    "start_listening",
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
    executor: subprocess.Popen[bytes]
    scheduler: subprocess.Popen[bytes]
    executor_args: list[str]
    log_dir: Path
    ports: dict[str, int]  # the scheduler's --port-file: listen, metrics_port, http_listen (each if serving)

    @property
    def metrics_port(self) -> int:
        return self.ports["metrics_port"]

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http_listen']}"

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
        self.executor = start("executor_service", ["--listen", self.executor_address, *self.executor_args],
                              self.log_dir / "executor.log")
        wait_healthy(self.executor_address, self.executor)


async def run_script(script: str, *args: str, timeout: float = 120) -> bytes:
    """`python -c script args...`'s standard output, run from a worker thread with subprocess: its child runs no
    Python between fork and exec. (An event loop's subprocess transport runs the interpreter's after-fork hooks
    in the child, which can crash there while gRPC threads of this process hold their locks.)"""
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script, *args], cwd=ROOT,
                                   stdout=subprocess.PIPE, timeout=timeout, check=True)
    return done.stdout


@contextmanager
def refusing_address() -> Iterator[str]:
    """A loopback address that refuses connections for as long as it is held: its port is bound and never
    listened on, so no other process can take it meanwhile (an executor that is not there, for certain)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield loopback(s.getsockname()[1])


def process_gone(pid: int) -> bool:
    """The process has exited: no /proc entry, or only its zombie (or dead) entry left for a parent to reap."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def thread_count(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def rss_bytes(proc: subprocess.Popen[bytes]) -> int:
    return status_bytes(proc.pid, "VmRSS")


def served_ports(scheduler_args: list[str]) -> tuple[str, ...]:
    """The ports a scheduler started by running_stack with scheduler_args writes to its port file."""
    names = ["listen"]
    if "--http-listen" in scheduler_args:
        names.append("http_listen")
    metrics = [scheduler_args[i + 1] for i, a in enumerate(scheduler_args[:-1]) if a == "--metrics-port"]
    if not metrics or metrics[-1] != "-1":
        names.append("metrics_port")
    return tuple(names)


@contextmanager
def running_stack(tmp_path: Path, executor_args: list[str], scheduler_args: list[str] | None = None,
                  tls_ca: str | None = None) -> Iterator[Stack]:
    """A simulated or torch executor and a scheduler over it, each on a port it picked (port 0, --port-file);
    scheduler_args may add `--http-listen 127.0.0.1:0` (Stack.http_url) or `--metrics-port -1`."""
    executor, ex_ports = start_listening("executor_service", executor_args, tmp_path / "executor.log")
    ex_addr = loopback(ex_ports["listen"])
    args = ["--executor", ex_addr, "--metrics-port", "0", *(scheduler_args or [])]
    try:
        scheduler, ports = start_listening("scheduler_service", args, tmp_path / "scheduler.log")
    except BaseException:
        stop(executor)
        raise
    stack = Stack(loopback(ports["listen"]), ex_addr, executor, scheduler, executor_args, tmp_path, ports)
    try:
        if tls_ca is None:
            wait_healthy(ex_addr, executor)
        wait_healthy(stack.address, scheduler, tls_ca=tls_ca)
        stack.ports = wait_ports(port_file_of(tmp_path / "scheduler.log"), served_ports(args), scheduler)
        yield stack
    finally:
        stop(stack.scheduler)
        stop(stack.executor)


@contextmanager
def running_http_stack(tmp_path: Path, executor_args: list[str], scheduler_args: list[str] | None = None
                       ) -> Iterator[Stack]:
    """running_stack with the OpenAI HTTP API on a port of its own (Stack.http_url)."""
    with running_stack(tmp_path, executor_args, ["--http-listen", "127.0.0.1:0", *(scheduler_args or [])]) as stack:
        yield stack


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
