"""The engine core's ipc:// socket file (#27): removed on every exit path the process itself survives, and the
files of killed pagedserve processes cleared at the next start, never a live one or anyone else's."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler_service.messages import OLD_IPC_FILE_MIN_AGE_S, clear_stale_ipc_files, ipc_address
from tests.support.procs import loopback, running_stack, start, start_listening, stop, wait_healthy


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A directory whose paths fit a Unix socket address (108 bytes): pytest's tmp_path may not."""
    path = Path(tempfile.mkdtemp(prefix="ps-ipc-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def left_socket(path: Path, listening: bool = False) -> socket.socket | None:
    """A Unix socket file at path: a closed one (what a killed process leaves), or one still listening."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    if listening:
        s.listen()
        return s
    s.close()
    return None


def pagedserve_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith("pagedserve-")}


def test_ipc_addresses_carry_the_pid() -> None:
    name = ipc_address("core").rsplit("/", 1)[1]
    assert name.startswith(f"pagedserve-core-{os.getpid()}-") and len(name) <= 40


def test_only_stale_sockets_of_pagedserve_processes_are_removed(short_tmp: Path) -> None:
    dead = dead_pid()
    stale = short_tmp / f"pagedserve-core-{dead}-0123abcd"
    left_socket(stale)
    mine_alive = short_tmp / f"pagedserve-core-{os.getpid()}-0123abcd"
    left_socket(mine_alive)
    # a pid that is dead here but a live listener (a process of another pid namespace sharing the directory)
    listener = left_socket(short_tmp / f"pagedserve-core-{dead}-4567abcd", listening=True)
    old_unnamed = short_tmp / "pagedserve-core-0123456789ab"
    left_socket(old_unnamed)
    past = time.time() - OLD_IPC_FILE_MIN_AGE_S - 5
    os.utime(old_unnamed, (past, past), follow_symlinks=False)
    left_socket(short_tmp / "pagedserve-test-abcdef012345")  # no pid, too young to tell
    (short_tmp / f"pagedserve-core-{dead}-89abcdef").write_text("a plain file")
    left_socket(short_tmp / f"other-core-{dead}-0123abcd")
    try:
        removed = clear_stale_ipc_files(str(short_tmp))
        assert sorted(removed) == sorted([str(stale), str(old_unnamed)])
        assert pagedserve_files(short_tmp) == {mine_alive.name, f"pagedserve-core-{dead}-4567abcd",
                                               "pagedserve-test-abcdef012345", f"pagedserve-core-{dead}-89abcdef"}
        assert (short_tmp / f"other-core-{dead}-0123abcd").exists()
    finally:
        assert listener is not None
        listener.close()


def scheduler_files(directory: Path) -> set[str]:
    return {n for n in pagedserve_files(directory) if n.startswith("pagedserve-core-")}


def test_a_clean_sigterm_leaves_no_socket_file_and_a_start_clears_stale_ones(
        short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    stale = short_tmp / f"pagedserve-core-{dead_pid()}-0123abcd"
    left_socket(stale)
    with running_stack(short_tmp, ["--simulated"], ["--api-server-count", "1"]) as stack:
        assert not stale.exists(), "the stale file of a killed scheduler is removed at start"
        (live,) = scheduler_files(short_tmp)
        assert live.startswith(f"pagedserve-core-{stack.scheduler.pid}-")
        scheduler = stack.scheduler
    assert scheduler.returncode == 0
    assert scheduler_files(short_tmp) == set(), "SIGTERM: the socket file is gone"
    log = (short_tmp / "scheduler.log").read_text()
    assert "removed 1 stale ipc socket files of exited pagedserve processes" in log


def test_an_engine_core_that_fails_removes_its_socket_file(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(short_tmp))
    executor, ports = start_listening("executor_service", ["--simulated"], short_tmp / "executor.log")
    executor_address = loopback(ports["listen"])
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        wait_healthy(executor_address, executor)
        # the metrics port is taken: the engine core fails once its executor is there
        scheduler = start("scheduler_service", ["--listen", "127.0.0.1:0", "--executor", executor_address,
                                                "--metrics-port", str(taken.getsockname()[1]), "--api-server-count",
                                                "1"], short_tmp / "scheduler.log")
        try:
            scheduler.wait(timeout=90)
            assert scheduler.returncode != 0
            assert "address already in use" in (short_tmp / "scheduler.log").read_text().lower()
            assert scheduler_files(short_tmp) == set(), "an error exit removes the socket file too"
        finally:
            stop(scheduler, signal.SIGKILL)
    finally:
        taken.close()
        stop(executor)
