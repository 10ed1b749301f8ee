import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Mapping

import pytest
import uvloop

pytest_plugins = ["tests.support.watchdog"]  # bounds the time between tests and after the last one


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], object]]:
    return {"uvloop": uvloop.new_event_loop}
