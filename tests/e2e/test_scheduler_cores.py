"""--cpu-cores on the scheduler (#29): the engine core and its api servers run bound to the cores given (as `taskset
-c` would), so that on a CPU box the scheduler side can be kept beside, or away from, the executor's threads; a
malformed or absent core is refused naming the flag."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.cpu_cores import parse_cores
from tests.e2e.test_cpu_nice import EXECUTOR, api_servers
from tests.support.procs import ROOT, running_stack


def test_the_engine_core_and_its_api_servers_are_bound_to_the_cores_given(tmp_path: Path) -> None:
    last = max(os.sched_getaffinity(0))
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2", "--cpu-cores", str(last)]) as s:
        servers = api_servers(s)
        assert len(servers) == 2
        assert [os.sched_getaffinity(pid) for pid in (s.scheduler.pid, *servers)] == [{last}] * 3
        unbound = {tid: cores for pid in (s.scheduler.pid, *servers) for tid, cores in thread_cores(pid).items()
                   if cores != {last}}
        assert unbound == {}, "threads started at import (OpenBLAS's pool under numpy) are bound too"
        assert os.sched_getaffinity(s.executor.pid) == os.sched_getaffinity(0)


def test_by_default_the_scheduler_side_keeps_the_cores_it_was_started_on(tmp_path: Path) -> None:
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "1"]) as s:
        assert [os.sched_getaffinity(pid) for pid in (s.scheduler.pid, *api_servers(s))] == \
            [os.sched_getaffinity(0)] * 2


def test_a_malformed_or_absent_core_is_refused_naming_the_flag() -> None:
    for value in ("1x", "3-1", "-2", "4096"):
        done = subprocess.run([sys.executable, "-m", "scheduler_service", "--cpu-cores", value], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("--cpu-cores") and ("bad core range" in last or "cannot bind" in last), last


def test_an_open_range_an_empty_part_or_an_impossible_core_is_malformed() -> None:
    for value in ("5-", "1,,2", ",", "0-9000", "99999999999", "\u0661"):
        with pytest.raises(ValueError, match="bad core range"):
            parse_cores(value)
    assert parse_cores(" 0-2 , 5 ") == {0, 1, 2, 5}
    assert parse_cores("  ") == set()


def test_a_core_outside_the_allowed_set_is_refused_not_dropped() -> None:
    """The kernel binds '0,4000' to core 0 alone without an error (4000 is beyond the machine, or its cpuset)."""
    first = min(os.sched_getaffinity(0))
    code = f"from scheduler_service.process import bind_cores; bind_cores('{first},4000')"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"--cpu-cores {first},4000: cannot bind to cores 4000"), last


def thread_cores(pid: int) -> dict[int, set[int]]:
    """Each thread of process `pid` and the cores it may run on (a thread that ended meanwhile left out)."""
    found: dict[int, set[int]] = {}
    for tid in (int(t) for t in os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(ProcessLookupError):
            found[tid] = os.sched_getaffinity(tid)
    return found
