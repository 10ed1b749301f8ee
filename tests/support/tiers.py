"""The three tiers as separate processes on 127.0.0.1 for tests: one simulated executor, one engine core listening
for front-ends on tcp://, and front-end processes (`python -m scheduler_service.frontend`) sharing one public
port (SO_REUSEPORT, as replicas behind a Service). Every process started is stopped at the end. The first of each
binds port 0 and says which port it got in its --port-file; the core restarted and the front-ends after the first
bind those ports again."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from client.local import (
    loopback,
    parse_metrics,
    port_file_of,
    start,
    start_listening,
    stop,
    wait_healthy,
    wait_until,
)
from client.port_file import wait_ports

ANY_PORT = "127.0.0.1:0"


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
        """The engine core on core_address and metrics_port (the first time port 0: then the ports it bound)."""
        self.starts += 1
        log = self.log_dir / f"core-{self.starts}.log"
        self.core = start("scheduler_service", ["--engine-core-listen", self.core_address, "--api-server-count",
                                                "0", "--executor", self.executor_address, "--metrics-port",
                                                str(self.metrics_port), "--port-file", str(port_file_of(log)),
                                                *self.core_args], log)
        if self.core_address.endswith(":0"):
            port = wait_ports(port_file_of(log), ("engine_core_listen",), self.core)["engine_core_listen"]
            self.core_address = f"{self.core_address.removesuffix(':0')}:{port}"
        if self.metrics_port == 0:  # written once the core has its executor
            self.metrics_port = wait_ports(port_file_of(log), ("metrics_port",), self.core)["metrics_port"]
        return self.core

    def start_frontend(self, public: str | None = None) -> subprocess.Popen[bytes]:
        """A front-end on the shared public ports (the first one picks them), or with `public`, on that gRPC
        address (and no HTTP; port 0: see its port file)."""
        self.starts += 1
        log = self.log_dir / f"frontend-{self.starts}.log"
        ports = ["--listen", public] if public else ["--listen", self.public, "--http-listen", self.http]
        proc = start("scheduler_service.frontend", ["--engine-core", self.core_address, *ports, "--port-file",
                                                    str(port_file_of(log)), *self.frontend_args], log)
        self.frontends.append(proc)
        if public is None and self.public == ANY_PORT:
            bound = wait_ports(port_file_of(log), ("listen", "http_listen"), proc)
            self.public, self.http = loopback(bound["listen"]), loopback(bound["http_listen"])
        return proc

    def start_other_frontend(self) -> tuple[str, subprocess.Popen[bytes]]:
        """A front-end on a gRPC port of its own (no HTTP), and its address."""
        proc = self.start_frontend(ANY_PORT)
        return loopback(wait_ports(port_file_of(self.log_dir / f"frontend-{self.starts}.log"), ("listen",),
                                   proc)["listen"]), proc

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
    tiers = Tiers(tmp_path, "", "tcp://127.0.0.1:0", 0, ANY_PORT, ANY_PORT, core_args or [], frontend_args or [])
    try:
        tiers.executor, ports = start_listening("executor_service", executor_args, tmp_path / "executor.log")
        tiers.executor_address = loopback(ports["listen"])
        wait_healthy(tiers.executor_address, tiers.executor)
        tiers.start_core()
        for _ in range(frontends):
            frontend = tiers.start_frontend()
            wait_healthy(tiers.public, frontend, tiers.core)  # type: ignore[arg-type]
        yield tiers
    finally:
        tiers.stop_all()
