"""Fail-stop for the tensor-parallel executor: a dead child rank, a dead parent or a failed collective
ends the whole process group's executor (every rank exits, rank 0 without answering the step in flight),
and the scheduler sees a lost executor and recomputes. Idle, rank 0 broadcasts a heartbeat every
`heartbeat_interval` that every rank answers, so a peer that hangs is found within --distributed-timeout."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from multiprocessing.process import BaseProcess

log = logging.getLogger("pagedserve.executor")
MAX_HEARTBEAT_S = 5.0
STOP_GRACE_S = 10.0


def heartbeat_interval(timeout: float) -> float:
    return max(0.05, min(MAX_HEARTBEAT_S, timeout / 4))


class Guard:
    """Fail-stop for one process: a dead child rank, a dead parent or a failed collective ends it (after
    terminating its children) without answering anything more."""

    def __init__(self) -> None:
        self.children: list[BaseProcess] = []
        self.stopping = False
        self._failing = False
        self._lock = threading.Lock()
        self._never = threading.Event()

    def fail(self, reason: str) -> None:
        """End the process; returns only during a graceful stop. A failure found while another thread is
        already ending the process (a dead rank seen by the watcher and by the collective in flight) waits
        for that exit, so its caller never answers the step in flight."""
        with self._lock:
            if self.stopping and not self._failing:
                return
            first = not self._failing
            self._failing = self.stopping = True
        if not first:
            self._never.wait()
        log.error("tensor-parallel executor going down: %s", reason)
        self.stop_children(graceful=False)
        logging.shutdown()
        os._exit(1)

    def watch_children(self) -> None:
        if self.children:
            threading.Thread(target=self._wait_children, name="rank-watch", daemon=True).start()

    def _wait_children(self) -> None:
        sentinels = {child.sentinel: child for child in self.children}
        ready = multiprocessing.connection.wait(list(sentinels))
        child = sentinels[ready[0]]  # type: ignore[index]
        child.join(1.0)
        if not self.stopping:
            self.fail(f"{child.name} (pid {child.pid}) exited with code {child.exitcode}")

    def watch_parent(self, parent_pid: int) -> None:
        threading.Thread(target=self._wait_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()

    def _wait_parent(self, parent_pid: int) -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        self.fail(f"parent process {parent_pid} is gone")

    def stop_children(self, graceful: bool) -> None:
        deadline = time.monotonic() + (STOP_GRACE_S if graceful else 0.0)
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.terminate()
        for child in self.children:
            child.join(2.0)
            if child.is_alive():
                child.kill()
                child.join()
