"""Rank 0's tensor-parallel Backend, which sends each call over the step channel before running it, and
`follow`, the loop of every other rank, which runs what rank 0 sends. The row-parallel all-reduces and the
logits all-gather happen inside the forward pass on every rank."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from executor_service.backend import BackendLost, BatchItem, BlockMap, SampleOutput
from executor_service.parallel.channel import Op, StepChannel
from executor_service.runner.torch_backend import Batch, TorchBackend

log = logging.getLogger("pagedserve.executor")


def follow(backend: TorchBackend, channel: StepChannel) -> None:
    """A rank other than 0: run what rank 0 broadcasts, in order, until it says stop."""
    while True:
        message = channel.receive()
        match message.op:
            case Op.EXECUTE:
                backend.run_batch(message.batch)
            case Op.SWAP_OUT:
                backend.swap_out(message.mapping)
            case Op.SWAP_IN:
                backend.swap_in(message.mapping)
            case Op.COPY:
                backend.copy(message.mapping)
            case Op.HEARTBEAT:
                channel.answer_heartbeat()
            case Op.STOP:
                return


class TensorParallelBackend:
    """Rank 0's Backend: each call is checked here, broadcast, then run here and on every rank in step.
    A failed broadcast or collective calls on_failure (fail-stop), so no half-run step is ever answered; if
    on_failure returns (the executor is stopping anyway), the call raises BackendLost, which ends the stream."""

    def __init__(self, local: TorchBackend, channel: StepChannel, on_failure: Callable[[str], None],
                 heartbeat_s: float) -> None:
        self.info = local.info
        self.local = local
        self.channel = channel
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), name="tp-heartbeat", daemon=True)
        self._heartbeat.start()
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def execute_async(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        return await asyncio.get_running_loop().run_in_executor(self._forward_thread, self.execute, items)

    def swap_out(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.SWAP_OUT, mapping, self.local.swap_out)

    def swap_in(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.SWAP_IN, mapping, self.local.swap_in)

    def copy(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.COPY, mapping, self.local.copy)

    def execute(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        if not items:
            return []
        with self._lock:
            batch = self.local.prepare(items)  # bad input raises here, before anything is sent
            try:
                self._send(Op.EXECUTE, batch=batch)
                logits = self.local.run_batch(batch)
            except Exception as e:
                self.on_failure(f"forward pass: {e}")
                raise BackendLost(f"forward pass: {e}") from e
        return self.local.sample(items, batch, logits)

    def close(self) -> None:
        """Tell every rank to exit (the executor is shutting down)."""
        self._closed.set()
        with self._lock:
            try:
                self._send(Op.STOP)
            except Exception as e:
                log.warning("could not tell the ranks to stop: %s", e)

    def _run_blocks(self, op: Op, mapping: BlockMap, run: Callable[[BlockMap], None]) -> None:
        if not mapping:
            return
        with self._lock:
            run(mapping)  # checks the block ids; a bad mapping raises before anything is sent
            try:
                self._send(op, mapping)
            except Exception as e:
                self.on_failure(f"{op.name.lower()}: {e}")
                raise BackendLost(f"{op.name.lower()}: {e}") from e

    def _send(self, op: Op, mapping: BlockMap | None = None, batch: Batch | None = None) -> None:
        self.channel.send(op, mapping, batch)
        self._last_send = time.monotonic()

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval):
            with self._lock:
                if self._closed.is_set() or time.monotonic() - self._last_send < interval:
                    continue
                try:
                    self._send(Op.HEARTBEAT)
                    self.channel.answer_heartbeat()
                except Exception as e:
                    self.on_failure(f"heartbeat: {e}")
                    return
