"""--port-file: the ports a service bound, for whoever started it with port 0.

A service started with `--listen 127.0.0.1:0` (or `--http-listen HOST:0`, `--metrics-port 0`,
`--engine-core-listen tcp://HOST:0`) binds a port the kernel picks, which nobody else can take in between; with
`--port-file PATH` it writes each port it has bound into PATH as one JSON object, keyed by the flag's name
(`{"listen": 41234, "http_listen": 41235, "metrics_port": 41236}`). The file is rewritten whole (written beside
and renamed over), so a reader never sees half of it; keys appear as their ports are bound (the metrics port once
an executor is connected).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class PortFile:
    """The writer: record(name, port) as each port is bound. No path: records nothing."""

    path: str | None
    ports: dict[str, int] = field(default_factory=dict)

    def record(self, name: str, port: int) -> None:
        if self.path is None:
            return
        self.ports[name] = port
        target = Path(self.path)
        # a new file of a name nobody can guess (O_EXCL): a link planted at a predictable name in a shared
        # directory such as /tmp would have had this process write through it into any file it may write
        fd, partial = tempfile.mkstemp(prefix=f"{target.name}.", suffix=".partial", dir=target.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.ports, f)
            os.chmod(partial, 0o644)  # readable by whoever started the service, as an ordinary file
            os.replace(partial, self.path)
        except OSError:
            with contextlib.suppress(OSError):  # no half-written file left beside it
                os.unlink(partial)
            raise


def check_port_file(path: str | None) -> None:
    """SystemExit naming the flag where --port-file cannot be written, checked before any port is bound: a
    directory, a missing or unwritable directory raised a traceback once the first port was bound (and a
    directory left a `.partial` file beside it)."""
    if path is None:
        return
    target = Path(path)
    parent = target.parent
    problem = ""
    if target.is_dir():
        problem = "is a directory"
    elif not parent.is_dir():
        problem = f"its directory {parent} does not exist"
    elif not os.access(parent, os.W_OK | os.X_OK):
        problem = f"its directory {parent} is not writable"
    if problem:
        raise SystemExit(f"--port-file {path}: {problem}")


def read_ports(path: Path) -> dict[str, int]:
    """The ports written so far ({} before the file exists)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    ports = json.loads(text)
    return {str(name): int(port) for name, port in ports.items()}


def wait_ports(path: Path, names: tuple[str, ...], proc: subprocess.Popen[bytes] | None = None,
               timeout: float = 120.0) -> dict[str, int]:
    """Wait until the port file at path has every one of names; fail early when proc exits first."""
    deadline = time.monotonic() + timeout
    while True:
        ports = read_ports(path)
        if all(name in ports for name in names):
            return ports
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before writing {', '.join(names)} to {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no {', '.join(n for n in names if n not in ports)} after {timeout}s")
        time.sleep(0.02)
