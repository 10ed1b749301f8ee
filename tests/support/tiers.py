"""The three tiers as separate processes on 127.0.0.1 for tests: one simulated executor, one engine core listening
for front-ends on tcp://, and front-end processes (`python -m scheduler_service.frontend`) sharing one public
port (SO_REUSEPORT, as replicas behind a Service). Every process started is stopped at the end."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from client.local import free_port, parse_metrics, start, stop, wait_healthy, wait_until


@dataclass
class Tiers:
    log_dir: Path
    executor_address: str
    core_address: str
    metrics_port: int
    public: str
    http: str
    core_args: list[str]
    frontend_args: list[str]
    executor: subprocess.Popen[bytes] | None = None
    core: subprocess.Popen[bytes] | None = None
    frontends: list[subprocess.Popen[bytes]] = field(default_factory=list)
    starts: int = 0

    def start_core(self) -> subprocess.Popen[bytes]:
        self.starts += 1
        self.core = start("scheduler_service", ["--engine-core-listen", self.core_address, "--api-server-count",
                                                "0", "--executor", self.executor_address, "--metrics-port",
                                                str(self.metrics_port), *self.core_args],
                          self.log_dir / f"core-{self.starts}.log")
        return self.core

    def start_frontend(self, public: str | None = None) -> subprocess.Popen[bytes]:
        """A front-end on the shared public ports, or with `public`, on that gRPC address (and no HTTP)."""
        self.starts += 1
        ports = ["--listen", public] if public else ["--listen", self.public, "--http-listen", self.http]
        proc = start("scheduler_service.frontend", ["--engine-core", self.core_address, *ports, *self.frontend_args],
                     self.log_dir / f"frontend-{self.starts}.log")
        self.frontends.append(proc)
        return proc

    def kill_core(self, sig: int = signal.SIGKILL) -> None:
        if self.core is not None:
            stop(self.core, sig)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        return parse_metrics(text)

    def idle(self) -> bool:
        """The core holds no block and no request (running, waiting or swapped)."""
        m = self.metrics()
        return (m.get("pagedserve:device_blocks_used", 0) == 0 and m.get("vllm:num_requests_running", 0) == 0
                and m.get("vllm:num_requests_waiting", 0) == 0 and m.get("vllm:num_requests_swapped", 0) == 0)

    def wait_idle(self, timeout: float = 30.0) -> None:
        wait_until(self.idle, timeout, "the engine core to hold no request and no block")

    def stop_all(self) -> None:
        for proc in [*self.frontends, self.core, self.executor]:
            if proc is not None:
                stop(proc)


@contextmanager
def running_tiers(tmp_path: Path, executor_args: list[str], core_args: list[str] | None = None,
                  frontend_args: list[str] | None = None, frontends: int = 1) -> Iterator[Tiers]:
    ex = f"127.0.0.1:{free_port()}"
    tiers = Tiers(tmp_path, ex, f"tcp://127.0.0.1:{free_port()}", free_port(), f"127.0.0.1:{free_port()}",
                  f"127.0.0.1:{free_port()}", core_args or [], frontend_args or [])
    try:
        tiers.executor = start("executor_service", ["--listen", ex, *executor_args], tmp_path / "executor.log")
        wait_healthy(ex, tiers.executor)
        tiers.start_core()
        for _ in range(frontends):
            wait_healthy(tiers.public, tiers.start_frontend(), tiers.core)  # type: ignore[arg-type]
        yield tiers
    finally:
        tiers.stop_all()
