"""Start the real services as processes on 127.0.0.1 for tests, and read their metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.lib import PagedServeClient

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(address: str, proc: subprocess.Popen[bytes], timeout: float = 120.0,
                 tls_ca: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()))
               if tls_ca else grpc.insecure_channel(address))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode} before {address} was healthy")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not healthy after {timeout}s")


def start(module: str, args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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


def parse_metrics(text: str) -> dict[str, float]:
    """Metric samples summed over labels other than finished_reason/mode/code, keyed by name{value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        for key in ("finished_reason", "mode", "code"):
            marker = f'{key}="'
            if marker in name_labels:
                name += "{" + name_labels.split(marker, 1)[1].split('"', 1)[0] + "}"
        out[name] = out.get(name, 0.0) + float(value)
    return out


def thread_count(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def rss_bytes(proc: subprocess.Popen[bytes]) -> int:
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_until(predicate: object, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


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
