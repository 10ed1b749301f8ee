import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Mapping

import pytest
import uvloop

# the watchdog bounds the time between tests and after the last one; syntax_checks runs the C++ syntax checks in
# the background
pytest_plugins = ["tests.support.watchdog", "tests.support.syntax_checks"]


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], object]]:
    return {"uvloop": uvloop.new_event_loop}
