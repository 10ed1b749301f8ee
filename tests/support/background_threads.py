"""The executor's background threads are waited for before the test process exits (a pytest plugin:
tests/conftest.py loads it).

An in-process TorchBackend measures and packs its linears after ready on daemon threads ("pack-after-ready",
"calibrate"). A test is done with its backend long before that work ends, and a Python process that finalizes
while a daemon thread is inside a torch op aborts ("terminate called without an active exception", exit status
134: the thread is unwound through C++ frames that may not throw). The executor itself leaves with os._exit, so
only in-process users such as the tests meet it. The wait stays under the watchdog's gap after the last test.
"""

from __future__ import annotations

import threading

import pytest

BACKGROUND_THREADS = ("pack-after-ready", "calibrate")
WAIT_S = 90.0


def background_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in BACKGROUND_THREADS and t.is_alive()]


def pytest_unconfigure(config: pytest.Config) -> None:
    for thread in background_threads():
        thread.join(WAIT_S)
