from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_loop import simulated_executor, streams_open
from tests.support.procs import wait_until


@pytest.fixture(scope="module")
def executor_args() -> list[str]:
    """The simulated executor's flags besides --simulated and --listen (a module overrides this fixture)."""
    return []


@pytest.fixture(scope="module")
def executor_process(tmp_path_factory: pytest.TempPathFactory, executor_args: list[str]) -> Iterator[tuple[str, Path]]:
    """A simulated executor process for the module, healthy: its address and log. Each test's engine loop opens an
    Execute stream of its own, and the executor clears its request state at each new stream (the simulated backend
    keeps nothing else per request)."""
    log = tmp_path_factory.mktemp("executor") / "executor.log"
    with simulated_executor(log, *executor_args) as address:
        yield address, log


@pytest.fixture
def executor(executor_process: tuple[str, Path]) -> Iterator[str]:
    """The module's executor's address; after the test, waits until every stream the test opened has ended, so that
    the next test's stream is never refused as a second scheduler's."""
    address, log = executor_process
    yield address
    wait_until(lambda: streams_open(log) == 0, timeout=60, what="the test's Execute streams to end")
