"""The engine core's handle on its grammar compile process (grammar_worker.py), used from the compile thread: each
compile gets --structured-outputs-compile-timeout seconds, counted from the order sent (the process's start-up and
its tokenizer set-up are not counted); past them, or once the compile's request has ended (its client left), the
process is killed and a fresh one started for the next compile. A process that is gone before a compile's order
reaches it (killed while idle, or dead in its start-up or tokenizer set-up) is replaced once, on the same compile;
one that dies after (a crash in xgrammar the constraint may have caused) fails that compile.

A handle given IdleProcesses takes a started process from them instead of starting one (its start-up, about 3 s of
importing xgrammar and torch, is then paid once for many handles), and gives its process back when closed between
compiles; the engine core's loops keep none (a handle's process lives as long as its loop), the tests share them."""

from __future__ import annotations

import contextlib
import logging
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import IO

import msgspec

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import Constraint
from scheduler_service.engine.grammar_worker import Compile, Reply, Tokenizer, read_frame, write_frame

log = logging.getLogger("pagedserve.grammar")
POLL_S = 0.05
"""How often a waiting compile checks whether its request still wants it."""
START_TIMEOUT_S = 120.0
"""How long the process may take to import xgrammar, or to build a tokenizer's compiler (not a compile)."""


class CompileTimeout(Exception):
    """The compile ran past its deadline; the process was killed."""


class CompileCancelled(Exception):
    """The compile's request ended while it ran; the process was killed."""


class CompileProcessFailed(Exception):
    """The process died or answered nonsense (a crash in xgrammar): not the constraint's fault, as far as known."""


TokenizerKey = tuple[str, int, tuple[int, ...]]


class IdleProcesses:
    """Started compile processes between compiles (past their start-up Reply), each with the tokenizer it has."""

    def __init__(self) -> None:
        self._idle: list[tuple[subprocess.Popen[bytes], TokenizerKey | None]] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[subprocess.Popen[bytes], TokenizerKey | None] | None:
        """A live idle process and its tokenizer, or None."""
        with self._lock:
            while self._idle:
                proc, key = self._idle.pop()
                if proc.poll() is None:
                    return proc, key
                end(proc)
        return None

    def keep(self, proc: subprocess.Popen[bytes], tokenizer: TokenizerKey | None) -> None:
        with self._lock:
            self._idle.append((proc, tokenizer))

    def close(self) -> None:
        """End every idle process."""
        with self._lock:
            idle, self._idle = self._idle, []
        for proc, _ in idle:
            end(proc)


class CompileChild:
    """One compile process for one tokenizer at a time; compile() blocks (call it off the event loop)."""

    def __init__(self, timeout: float, idle: IdleProcesses | None = None) -> None:
        self.timeout = timeout
        self.idle = idle
        self._proc: subprocess.Popen[bytes] | None = None
        self._tokenizer: TokenizerKey | None = None  # the one the process has
        self._started = False  # whether the process's start-up Reply was read
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self._compiling = threading.Lock()  # held through each compile: close() gives back only an idle process
        self.killed = 0  # processes killed mid-compile (deadline or request gone)

    def compile(self, describe: executor_pb2.DescribeResponse, constraint: Constraint,
                wanted: Callable[[], bool] | None = None) -> Reply:
        """The process's Reply to the constraint: ok with the compiled grammar's JSON, or not ok with why the
        constraint does not compile. CompileTimeout, CompileCancelled, CompileProcessFailed otherwise."""
        with self._compiling:
            try:
                self._order(describe, constraint)
            except CompileProcessFailed as e:  # before the order reached it: not the constraint's doing
                log.warning("%s before a compile; starting a fresh one for it", e)
                self._order(describe, constraint)
            return self._reply(time.monotonic() + self.timeout, wanted)

    def _order(self, describe: executor_pb2.DescribeResponse, constraint: Constraint) -> None:
        self._prepare(describe)
        self._send(Compile(constraint.kind.value, constraint.spec))

    def begin(self) -> None:
        """Start a process now if there is none, without waiting for its start-up (it imports xgrammar while the
        caller works: the engine core imports its own copy before its first compile)."""
        with self._compiling:
            self._begin()

    def _begin(self) -> None:
        if self._proc is not None:
            return
        taken = self.idle.take() if self.idle is not None else None
        if taken is not None:
            (self._proc, self._tokenizer), self._started = taken, True
        else:
            self._proc, self._tokenizer, self._started = spawn(), None, False

    def _prepare(self, describe: executor_pb2.DescribeResponse) -> None:
        """A started process that has this describe's tokenizer (start-up and set-up: no compile deadline)."""
        key = (describe.tokenizer_json, describe.vocab_size, tuple(describe.eos_token_ids))
        self._begin()
        if not self._started:
            self._expect_ok(self._reply(time.monotonic() + START_TIMEOUT_S, None), "start")
            self._started = True
        if self._tokenizer != key:
            self._send(Tokenizer(describe.SerializeToString()))
            self._expect_ok(self._reply(time.monotonic() + START_TIMEOUT_S, None), "tokenizer set-up")
            self._tokenizer = key

    def _expect_ok(self, reply: Reply, what: str) -> None:
        if not reply.ok:
            self._end()
            raise CompileProcessFailed(f"the grammar compile process failed its {what}: {reply.text}")

    def _send(self, order: Compile | Tokenizer) -> None:
        proc = self._proc
        try:
            if proc is None or proc.stdin is None:
                raise OSError("not started")
            write_frame(proc.stdin, self._encoder.encode(order))
        except OSError as e:  # it died: the next compile starts another
            self._end()
            raise CompileProcessFailed(f"the grammar compile process is gone ({e})") from None

    def _reply(self, deadline: float, wanted: Callable[[], bool] | None) -> Reply:
        proc = self._proc
        if proc is None or proc.stdout is None:
            raise CompileProcessFailed("the grammar compile process is gone")
        while not readable(proc.stdout, min(POLL_S, max(0.0, deadline - time.monotonic()))):
            if wanted is not None and not wanted():
                self._kill("its request ended")
                raise CompileCancelled()
            if time.monotonic() >= deadline:
                self._kill("past its deadline")
                raise CompileTimeout()
        frame = read_frame(proc.stdout)
        if frame is None:
            code = self._end()
            raise CompileProcessFailed(f"the grammar compile process died (exit code {code})")
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as e:
            self._end()
            raise CompileProcessFailed(f"the grammar compile process answered nonsense ({e})") from None

    def _kill(self, why: str) -> None:
        self.killed += 1
        log.info("grammar compile process %d killed: the compile was %s", self._proc.pid if self._proc else 0, why)
        self._end()

    def close(self) -> None:
        """Give the process back to the idle ones if given and no compile runs; else end it (a compile running on
        the compile thread ends with it)."""
        if self.idle is not None and self._compiling.acquire(blocking=False):
            try:
                if self._proc is not None and self._started:
                    proc, self._proc = self._proc, None
                    self.idle.keep(proc, self._tokenizer)
            finally:
                self._compiling.release()
        self._end()

    def _end(self) -> int | None:
        """End the process (if any); its exit code."""
        proc, self._proc = self._proc, None
        return end(proc) if proc is not None else None


def end(proc: subprocess.Popen[bytes]) -> int:
    """Kill the process and close its pipes; its exit code."""
    proc.kill()
    code = proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):  # an order left in the buffer of a dead process's pipe: EPIPE
                stream.close()
    return code


def spawn() -> subprocess.Popen[bytes]:
    """A new compile process; its stderr is the engine core's (a crash's traceback lands in its log)."""
    return subprocess.Popen([sys.executable, "-m", "scheduler_service.engine.grammar_worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)


def readable(stream: IO[bytes], timeout: float) -> bool:
    return bool(select.select([stream], [], [], timeout)[0])
