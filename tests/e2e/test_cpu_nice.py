"""--cpu-nice (#29): the scheduler side (engine core and its api servers) runs at a raised nice value, so that on
cores it shares with a CPU executor it yields to the executor's OpenMP team; out-of-range values are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT, Stack, running_stack

EXECUTOR = ["--simulated", "--sim-step-latency-ms", "5"]


def nice_of(pid: int) -> int:
    """The nice value of process pid (field 19 of /proc/PID/stat)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def api_servers(stack: Stack) -> list[int]:
    """The scheduler's children started by multiprocessing spawn."""
    found: list[int] = []
    for task in Path(f"/proc/{stack.scheduler.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    return found


def test_the_engine_core_and_its_api_servers_run_at_the_raised_nice_value(tmp_path: Path) -> None:
    base = os.nice(0)
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2", "--cpu-nice", "7"]) as s:
        servers = api_servers(s)
        assert len(servers) == 2
        assert [nice_of(pid) for pid in (s.scheduler.pid, *servers)] == [min(base + 7, 19)] * 3
        assert nice_of(s.executor.pid) == base


def test_by_default_the_scheduler_side_keeps_its_nice_value(tmp_path: Path) -> None:
    base = os.nice(0)
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "1"]) as s:
        assert [nice_of(pid) for pid in (s.scheduler.pid, *api_servers(s))] == [base, base]


def test_a_nice_value_out_of_range_is_refused_naming_the_flag() -> None:
    for value in ("20", "-1"):
        done = subprocess.run([sys.executable, "-m", "scheduler_service", "--cpu-nice", value], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        assert "--cpu-nice must be 0 - 19" in done.stderr
