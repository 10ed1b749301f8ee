"""A bound on the parts of a test run that no test's timeout covers (a pytest plugin: tests/conftest.py loads it).

pytest-timeout times each test (setup, call and teardown; `timeout_method = "thread"` in pyproject.toml, so a
call blocked in C where a signal cannot reach it is ended too). Between tests and after the last one nothing
is timed, and that is where an unclosed ZeroMQ context hangs: when a reference cycle holding a context and
one of its sockets is collected, the socket's weak reference is cleared before the context's __del__ runs,
so the context terminates without closing the socket and zmq_ctx_term waits for it forever. That hung a run
after its last test (tests/frontend/test_core_client.py with a failing assertion, issue #34).

So from the end of each test until the next one starts (and after the last, until the process exits) a
faulthandler timer runs: past PAGEDSERVE_TEST_GAP_TIMEOUT_S seconds (default 120) it writes every thread's
stack to stderr and exits with status 1.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

ENV = "PAGEDSERVE_TEST_GAP_TIMEOUT_S"
DEFAULT_S = 120.0
_stderr = -1


def gap_timeout_s() -> float:
    return float(os.environ.get(ENV, DEFAULT_S))


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    if _stderr < 0:  # the real stderr (capturing is suspended here), kept open for the dump
        _stderr = os.dup(2)


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    faulthandler.cancel_dump_traceback_later()  # the test's own timeout takes over


def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
    if _stderr >= 0:
        faulthandler.dump_traceback_later(gap_timeout_s(), exit=True, file=_stderr)
