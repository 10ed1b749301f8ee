"""What every process of the scheduler service sets up the same way: its log format and its garbage collector."""

from __future__ import annotations

import gc
import logging


def configure_logging(tag: str = "") -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")


def freeze_startup_objects() -> None:
    """Keep start-up objects out of the collector's way and collect the young generation less often:
    the engine loop allocates many short-lived objects per step."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 1000)
