"""A pool of executors on loopback addresses 127.0.0.N (one port) behind one scheduler that finds them
through a dns:/// name answered by --executor-hosts-file, so tests can change the name's addresses. The port is
the one the first executor started picks (port 0, --port-file), unless the pool is given one."""

from __future__ import annotations

import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from client.local import loopback, port_file_of, start, start_listening, stop, wait_healthy, wait_until
from client.port_file import wait_ports

NAME = "executors.pool.test"


@dataclass
class Pool:
    log_dir: Path
    port: int
    executor_args: list[str]
    hosts_file: Path
    drain_file: Path
    name: str = NAME
    address: str = ""
    metrics_port: int = 0
    scheduler: subprocess.Popen[bytes] | None = None
    executors: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def executor_address(self, n: int) -> str:
        return f"127.0.0.{n}:{self.port}"

    def start_executor(self, n: int, extra: list[str] | None = None) -> str:
        log = self.log_dir / f"executor-{n}.log"
        if self.port == 0:  # the first: its port is the pool's
            proc, ports = start_listening("executor_service", ["--listen", f"127.0.0.{n}:0", *self.executor_args,
                                                               *(extra or [])], log)
            self.port = ports["listen"]
        else:
            proc = start("executor_service", ["--listen", self.executor_address(n), *self.executor_args,
                                              *(extra or [])], log)
        address = self.executor_address(n)
        self.executors[address] = proc
        wait_healthy(address, proc)
        return address

    def kill_executor(self, address: str) -> None:
        stop(self.executors.pop(address), signal.SIGKILL)

    def publish(self, addresses: list[str]) -> None:
        """What NAME resolves to from now on (the scheduler re-reads it every resolve interval)."""
        lines = [f"{a.rsplit(':', 1)[0]} {self.name}" for a in addresses]
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(self.hosts_file)

    def drain(self, addresses: list[str]) -> None:
        tmp = self.drain_file.with_suffix(".tmp")
        tmp.write_text("".join(f"{a}\n" for a in addresses))
        tmp.replace(self.drain_file)

    def metrics_text(self) -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()

    def per_executor(self, name: str) -> dict[str, float]:
        """{executor address: value} of a series labelled `executor`."""
        out: dict[str, float] = {}
        for line in self.metrics_text().splitlines():
            if line.startswith(name + "{") and 'executor="' in line:
                executor = line.split('executor="', 1)[1].split('"', 1)[0]
                out[executor] = float(line.rsplit(" ", 1)[1])
        return out

    def serving(self) -> set[str]:
        return {a for a, v in self.per_executor("pagedserve:executor_serving").items() if v == 1.0}

    def wait_serving(self, addresses: set[str], timeout: float = 30.0) -> None:
        wait_until(lambda: self.serving() == addresses, timeout, f"serving executors == {sorted(addresses)}")


@contextmanager
def running_pool(tmp_path: Path, num_executors: int, executor_args: list[str],
                 scheduler_args: list[str] | None = None, resolve_interval: float = 0.2) -> Iterator[Pool]:
    pool = Pool(tmp_path, 0, executor_args, tmp_path / "hosts", tmp_path / "drain")
    try:
        started = [pool.start_executor(n) for n in range(1, num_executors + 1)]
        pool.publish(started)
        pool.scheduler, ports = start_listening("scheduler_service", [
            "--executor", f"dns:///{NAME}:{pool.port}", "--metrics-port", "0", "--executor-hosts-file",
            str(pool.hosts_file), "--executor-drain-file", str(pool.drain_file), "--executor-resolve-interval",
            str(resolve_interval), *(scheduler_args or [])], tmp_path / "scheduler.log")
        pool.address = loopback(ports["listen"])
        wait_healthy(pool.address, pool.scheduler)
        pool.metrics_port = wait_ports(port_file_of(tmp_path / "scheduler.log"), ("metrics_port",),
                                       pool.scheduler)["metrics_port"]
        pool.wait_serving(set(started))
        yield pool
    finally:
        if pool.scheduler is not None:
            stop(pool.scheduler)
        for proc in pool.executors.values():
            stop(proc)


