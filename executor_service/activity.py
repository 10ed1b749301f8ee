"""Whether the executor is serving steps (#33): work it leaves until after ready (torch's deferred imports, the heap's
freeze) runs only in a quiet moment, so that a step does not share the GIL or the event loop with it, except with
the piece of it already running when the step arrives.

The servicer wraps each step in StepActivity.step(); a background thread calls wait_quiet() before each piece of its
work. Quiet means no step in flight and none for QUIET_S: between the steps of a running batch the scheduler answers
in a few milliseconds, so a batch in progress is never quiet, and the work waits for the batch to end (at most a
minute in all: `__main__.pause_for_steps`; under load that never pauses it then runs anyway)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

QUIET_S = 0.05
"""How long after the last step ends the executor counts as idle (the scheduler's turnaround between two steps of a
running batch is 1 - 10 ms)."""
POLL_S = 0.02
"""How often a waiting thread asks `give_way` whether it must stop waiting."""


class StepActivity:
    """Steps in flight, counted by the thread that serves them; any thread may wait for a quiet moment."""

    def __init__(self, quiet_s: float = QUIET_S) -> None:
        self.quiet_s = quiet_s
        self.waiting = 0  # threads inside wait_quiet (read by tests)
        self._cond = threading.Condition()
        self._in_flight = 0
        self._last_end = float("-inf")

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Count a step in flight while the block runs."""
        with self._cond:
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._last_end = time.monotonic()
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def busy_for(self) -> float:
        """0 when quiet, else how long (s) until it could be (with a step in flight: at least a poll's length)."""
        if self._in_flight:
            return max(self.quiet_s, POLL_S)
        return max(0.0, self._last_end + self.quiet_s - time.monotonic())

    def wait_quiet(self, give_way: Callable[[], bool] | None = None, timeout: float | None = None) -> bool:
        """Block until quiet (True), or until `give_way()` says to stop waiting or `timeout` passes (False). With
        neither, a waiter sleeps through the steps in flight (the end of each wakes it) instead of polling."""
        deadline = None if timeout is None else time.monotonic() + timeout
        polls = give_way is not None or deadline is not None
        with self._cond:
            self.waiting += 1
            try:
                while (left := self.busy_for()) > 0:
                    if (give_way is not None and give_way()) or (deadline is not None and time.monotonic() >= deadline):
                        return False
                    self._cond.wait(min(left, POLL_S) if polls or not self._in_flight else None)
                return True
            finally:
                self.waiting -= 1
