"""The suite cannot hang: a test past its timeout is ended even when it is blocked where no signal reaches
it, and a hang after the last test (an unclosed ZeroMQ context collected at session end, issue #34) ends the
run too. Each case runs a tiny pytest in a subprocess that would otherwise never finish."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT
from tests.support.watchdog import ENV

BOUND_S = 45.0  # the whole tiny run, pytest's start-up included, on a loaded machine


def run_pytest(directory: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """pytest on `directory` with the project's configuration (pyproject.toml); fails the calling test if the
    run is still going after BOUND_S."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
               "--rootdir", str(directory), *args, str(directory)]
    try:
        return subprocess.run(command, cwd=directory, capture_output=True, text=True, timeout=BOUND_S,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the run did not end within {BOUND_S} s: a hang the timeouts did not catch\n{e.stdout!r}")


def test_a_test_blocked_where_no_signal_reaches_it_is_ended_by_its_timeout(tmp_path: Path) -> None:
    # SIGALRM blocked in the main thread stands for any call in C that a signal cannot end (ZeroMQ's
    # own threads block every signal, so a process-directed one waits forever).
    (tmp_path / "test_blocked.py").write_text(
        "import signal\n"
        "import zmq\n\n\n"
        "def test_blocked_in_a_zmq_recv():\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        "    ctx = zmq.Context()\n"
        "    sock = ctx.socket(zmq.PULL)\n"
        "    sock.bind('inproc://nobody-sends')\n"
        "    sock.recv()\n")
    done = run_pytest(tmp_path, "-o", "timeout=2")
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert "Timeout" in out and "test_blocked_in_a_zmq_recv" in out, out


def test_a_hang_after_the_last_test_ends_the_run(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    # The suite runs with both guards.
    assert pytestconfig.getini("timeout_method") == "thread"
    assert pytestconfig.pluginmanager.has_plugin("tests.support.watchdog")
    # What hung the run of #34: a context and its open socket in a reference cycle, collected after the last
    # test. The collection clears the socket's weak reference first, so the context's __del__ terminates it
    # with the socket still open, and zmq_ctx_term waits for that socket forever.
    (tmp_path / "conftest.py").write_text(
        "import gc\n\n"
        "pytest_plugins = ['tests.support.watchdog']\n\n\n"
        "def pytest_sessionfinish():\n"
        "    gc.collect()\n")
    (tmp_path / "test_leak.py").write_text(
        "import zmq\n\n\n"
        "def test_leaves_an_unclosed_context_in_a_cycle():\n"
        "    ctx = zmq.Context()\n"
        "    sock = ctx.socket(zmq.PUSH)\n"
        "    cycle = [ctx, sock]\n"
        "    cycle.append(cycle)\n")
    done = run_pytest(tmp_path, env={ENV: "3"})
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "[100%]" in out and "Timeout (0:00:03)!" in out and "in term" in out, out  # the test ran, then the hang
