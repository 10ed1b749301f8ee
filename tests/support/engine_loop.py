"""For tests of the engine loop in-process against a real simulated executor process: the process, and the
collection of one request's deltas."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scheduler_service.core.outputs import RequestDelta
from tests.support.procs import loopback, start_listening, stop, wait_healthy


@contextmanager
def simulated_executor(log_path: Path, *args: str) -> Iterator[str]:
    """A simulated executor process (`--simulated` and `args`) on 127.0.0.1, healthy; yields its address."""
    proc, ports = start_listening("executor_service", ["--simulated", *args], log_path)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        yield address
    finally:
        stop(proc)


async def collect(queue: asyncio.Queue[RequestDelta]) -> tuple[list[int], RequestDelta]:
    """One request's tokens and its last delta (the one with a finish reason)."""
    tokens: list[int] = []
    while True:
        delta = await queue.get()
        tokens += delta.new_token_ids
        if delta.finish_reason is not None:
            return tokens, delta


def streams_open(log_path: Path) -> int:
    """Execute streams a simulated executor holds open, from its log (it logs each one's start and end)."""
    text = log_path.read_text()
    return text.count(" connected (stream ") - text.count(" disconnected (stream ")
