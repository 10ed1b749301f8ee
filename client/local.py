"""pagedserve's services as local processes on 127.0.0.1: start, wait until healthy, read metrics, stop.

One home for what the launcher (`pagedserve serve`, client/serve.py), the tests and the benchmarks all do
with processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from client.port_file import wait_ports

ROOT = Path(__file__).resolve().parent.parent
METRIC_LABELS_KEPT = ("finished_reason", "mode", "code")


def free_port() -> int:
    """A port free now, for a process that must know it before it starts (another process may take it before
    then): prefer start_listening, where the service binds port 0 and says which port it got."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_healthy(address: str, *procs: subprocess.Popen[bytes], timeout: float = 120.0,
                 tls_ca: str | None = None) -> None:
    """Poll gRPC health checking at address until SERVING; fail early when any of procs exits."""
    deadline = time.monotonic() + timeout
    channel = (grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()))
               if tls_ca else grpc.insecure_channel(address))
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            exited = next((p for p in procs if p.poll() is not None), None)
            if exited is not None:
                raise RuntimeError(f"process exited with {exited.returncode} before {address} was healthy")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
    raise TimeoutError(f"{address} not healthy after {timeout}s")


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def start(module: str, args: list[str], log_path: Path, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    """`python -m module *args` from the repository root (or cwd: another tree's), stdout and stderr to log_path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def port_file_of(log_path: Path) -> Path:
    """Where start_listening has the service write its --port-file: beside its log."""
    return log_path.with_suffix(".ports")


def start_listening(module: str, args: list[str], log_path: Path, names: tuple[str, ...] = ("listen",)
                    ) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    """start() with `--listen 127.0.0.1:0 --port-file` (args may name other ports 0 too); once the service has
    written every port in names, the process and its ports so far (no port is picked before the process binds it,
    so none can be taken by another process in between)."""
    ports_path = port_file_of(log_path)
    ports_path.unlink(missing_ok=True)
    proc = start(module, ["--listen", "127.0.0.1:0", "--port-file", str(ports_path), *args], log_path)
    try:
        return proc, wait_ports(ports_path, names, proc)
    except BaseException:
        stop(proc)
        raise


def loopback(port: int) -> str:
    return f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def status_bytes(pid: int, key: str = "VmRSS") -> int:
    """A size from /proc/PID/status (VmRSS, RssAnon, ...), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/{pid}/status")


def child_pids(pid: int) -> dict[int, str]:
    """The processes whose parent is pid, with what they are: "api server" (a multiprocessing spawn child),
    "resource tracker" (multiprocessing's), or "child"."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        found[int(entry.name)] = ("resource tracker" if b"resource_tracker" in cmdline
                                  else "api server" if b"spawn_main" in cmdline else "child")
    return dict(sorted(found.items()))


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus samples summed over labels other than finished_reason/mode/code, keyed by name{value}.
    Counters keep their exposed `_total` name."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            for key in METRIC_LABELS_KEPT:
                if key in sample.labels:
                    name += "{" + sample.labels[key] + "}"
            out[name] = out.get(name, 0.0) + sample.value
    return out


@dataclass
class Service:
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def service(module: str, args: list[str], log_dir: Path | None = None, env: dict[str, str] | None = None,
            name: str | None = None, cwd: Path = ROOT) -> Iterator[Service]:
    """Start `python -m module --listen 127.0.0.1:0 *args` (the port it binds read from its --port-file; from cwd,
    whose package `module` is, the repository root by default), wait until healthy, stop it afterwards."""
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedserve-")))
        log = log_dir / f"{name or module}.log"
        saved = dict(os.environ)
        try:
            os.environ.update(env or {})
            proc = start(module, ["--listen", "127.0.0.1:0", "--port-file", str(port_file_of(log)), *args], log, cwd)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            address = loopback(wait_ports(port_file_of(log), ("listen",), proc, timeout=300.0)["listen"])
            wait_healthy(address, proc, timeout=300.0)
            yield Service(address, proc, log)
        except BaseException:
            sys.stderr.write(f"--- last lines of {log} ---\n")
            with contextlib.suppress(OSError):
                sys.stderr.write("\n".join(log.read_text(errors="replace").splitlines()[-30:]) + "\n")
            raise
        finally:
            stop(proc)
