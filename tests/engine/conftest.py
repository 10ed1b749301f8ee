from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engine_loop import simulated_executor


@pytest.fixture
def executor_args() -> list[str]:
    """The simulated executor's flags besides --simulated and --listen (a module overrides this fixture)."""
    return []


@pytest.fixture
def executor(tmp_path: Path, executor_args: list[str]) -> Iterator[str]:
    """The address of a simulated executor process that lives for the test."""
    with simulated_executor(tmp_path / "executor.log", *executor_args) as address:
        yield address
