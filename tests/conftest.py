import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Mapping

import pytest
import uvloop

# the watchdog bounds the time between tests and after the last one; syntax_checks runs the C++ syntax checks in
# the background; background_threads waits for the executor's packing threads before the process exits
pytest_plugins = ["tests.support.watchdog", "tests.support.syntax_checks", "tests.support.background_threads"]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], object]]:
    return {"uvloop": uvloop.new_event_loop}
