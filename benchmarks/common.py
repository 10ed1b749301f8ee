"""Helpers shared by the peer-comparison benchmarks (overhead, kv_usage, vs_transformers).

Each benchmark adds the repository root to sys.path itself, so `python benchmarks/NAME.py` works from the
root; this module only needs the standard library and the project's own test process helpers.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.procs import free_port, start, stop, wait_healthy  # noqa: E402


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of values (q in [0, 1]); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, object]:
    """What the numbers were measured on, and how busy it was (other work shares these cores)."""
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_1m": round(load[0], 2), "loadavg_5m": round(load[1], 2)}


def emit(record: dict[str, object], json_out: str | None = None) -> None:
    """Print one JSON line; also append it to json_out when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if json_out:
        with open(json_out, "a", encoding="utf-8") as f:
            f.write(line + "\n")


@dataclass
class Service:
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


@contextlib.contextmanager
def service(module: str, args: list[str], log_dir: Path | None = None, env: dict[str, str] | None = None,
            name: str | None = None) -> Iterator[Service]:
    """Start `python -m module --listen 127.0.0.1:PORT *args`, wait until healthy, stop it afterwards."""
    address = f"127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pagedserve-bench-")))
        log = log_dir / f"{name or module}.log"
        saved = dict(os.environ)
        try:
            os.environ.update(env or {})
            proc = start(module, ["--listen", address, *args], log)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            wait_healthy(address, proc, timeout=300.0)
            yield Service(address, proc, log)
        except BaseException:
            sys.stderr.write(f"--- last lines of {log} ---\n")
            with contextlib.suppress(OSError):
                sys.stderr.write("\n".join(log.read_text(errors="replace").splitlines()[-30:]) + "\n")
            raise
        finally:
            stop(proc)

