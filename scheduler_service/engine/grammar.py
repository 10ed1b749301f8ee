"""The engine core's side of structured outputs: constraints compiled for the executor's tokenizer (in a compile
process under a deadline, cached by spec), one matcher per constrained sequence, and each step's allowed-token
bitmasks.

A matcher follows its request's output tokens (sync() feeds it the tokens it has not seen), so preemption, swap and
an executor's loss need nothing: the output is kept, and so is the state. A step's mask is filled after schedule()
from the state after every token so far, which is why an ExecutorLoop holding constrained requests runs its steps
one at a time (the next mask needs the last token).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.request import Constraint
from scheduler_service.engine.fair_queue import FairQueue
from scheduler_service.engine.grammar_child import (
    CompileCancelled,
    CompileChild,
    CompileProcessFailed,
    CompileTimeout,
    IdleProcesses,
)
from scheduler_service.engine.grammar_vocab import tokenizer_vocab
from scheduler_service.structured import FIELD_NAMES, InvalidConstraint, clean_message

if TYPE_CHECKING:
    import xgrammar

    from scheduler_service.core.outputs import SchedulerOutput

COMPILED_CACHE_SIZE = 256
COMPILED_CACHE_BYTES = 256 * 1024 * 1024
"""And at most this much of them (xgrammar's memory_size_bytes): a 60 KB regex compiles to ~40 MB on a 2k
vocabulary, so 256 distinct ones from one client held ~10 GB in the engine core."""
TIMED_OUT_SIZE = 1024
TIMED_OUT_BYTES = 16 * 1024 * 1024
"""Constraints whose compile ran past the deadline are remembered, the most recent TIMED_OUT_SIZE within this much
spec text: a resend is refused at once instead of holding the compile process for the whole deadline again."""


class RequestGrammar:
    """One sequence's matcher and how many of its output tokens it has consumed."""

    __slots__ = ("consumed", "matcher")

    def __init__(self, matcher: xgrammar.GrammarMatcher) -> None:
        self.matcher = matcher
        self.consumed = 0

    def sync(self, output: list[int]) -> str:
        """Feed the output tokens the matcher has not seen; "" or why one was refused."""
        while self.consumed < len(output):
            token = output[self.consumed]
            if not self.matcher.accept_token(token):
                return f"the executor sampled token {token}, which the output's grammar forbids"
            self.consumed += 1
        return ""


DEFAULT_COMPILE_TIMEOUT_S = 10.0


@dataclass(slots=True, frozen=True)
class CompileFailure:
    """Why a constraint has no matcher; invalid: the constraint's fault (INVALID_ARGUMENT naming its field)."""

    message: str
    invalid: bool = False


@dataclass(slots=True)
class CompileJob:
    describe: executor_pb2.DescribeResponse
    constraint: Constraint
    wanted: Callable[[], bool] | None
    done: asyncio.Future[RequestGrammar | CompileFailure]


class GrammarCompiler:
    """Compiles constraints for one executor's tokenizer in a compile process of its own (grammar_child.py), one
    at a time, taking turns between the callers that sent them (a caller's many costly specs hold another's for at
    most one compile); each compile gets `timeout` seconds, and one whose request ends while it runs is killed with
    its process. The compiled grammars come back as xgrammar's JSON and are kept by (constraint, tokenizer), the
    most recent COMPILED_CACHE_SIZE of them within COMPILED_CACHE_BYTES: a repeated spec never reaches the
    process. So are the constraints that ran past the deadline (TIMED_OUT_SIZE, TIMED_OUT_BYTES): a resend is
    refused at once with the same error. Both are answered on the caller's thread, never queued behind the compile
    running: a request whose grammar was compiled before waited up to the whole deadline behind another's costly
    spec."""

    def __init__(self, timeout: float = DEFAULT_COMPILE_TIMEOUT_S, idle: IdleProcesses | None = None) -> None:
        self.timeout = timeout
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._child = CompileChild(timeout, idle)
        self._queue: FairQueue[CompileJob] = FairQueue()
        self._draining: asyncio.Task[None] | None = None
        self._info: xgrammar.TokenizerInfo | None = None
        self._tokenizer_key: tuple[str, int, tuple[int, ...]] | None = None
        self._compiled: OrderedDict[Constraint, xgrammar.CompiledGrammar] = OrderedDict()
        self._compiled_bytes = 0
        self._timed_out: OrderedDict[Constraint, float] = OrderedDict()  # -> the deadline it ran past
        self._timed_out_bytes = 0
        self._cache_lock = threading.Lock()  # both caches: the compile thread and the caller's use them

    async def matchers(self, describe: executor_pb2.DescribeResponse, constraints: list[Constraint],
                       wanted: Sequence[Callable[[], bool]] | None = None, owners: Sequence[str] | None = None
                       ) -> list[RequestGrammar | CompileFailure]:
        """A fresh matcher of each constraint, or why it has none. `wanted[i]()`, read on the compile thread
        before and while constraint i compiles, says whether its request still wants it: the compiles of requests
        that ended while they queued (a client that gave up) are skipped, and one running is killed, so that they
        do not hold every later constrained request up behind them. owners[i]: who sent constraint i (its API
        key's digest; "" for every anonymous caller), whose turn it waits for."""
        loop = asyncio.get_running_loop()
        jobs = [CompileJob(describe, c, wanted[i] if wanted else None, loop.create_future())
                for i, c in enumerate(constraints)]
        for i, job in enumerate(jobs):
            known = self._known_result(job)
            if known is not None:
                job.done.set_result(known)
            else:
                self._queue.push(owners[i] if owners else "", job)
        if self._draining is None or self._draining.done():
            self._draining = loop.create_task(self._drain(), name="grammar-compile")
        return list(await asyncio.gather(*(job.done for job in jobs)))

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while (job := self._queue.pop()) is not None:
            if job.done.done():  # its caller stopped waiting
                continue
            result: RequestGrammar | CompileFailure
            try:
                result = await loop.run_in_executor(self._pool, self._new_matcher_or_reason, job)
            except Exception as e:  # xgrammar's own failure ends its request, not the queue
                result = CompileFailure(f"structured_outputs: {clean_message(str(e))}")
            if not job.done.done():
                job.done.set_result(result)

    def _known_result(self, job: CompileJob) -> RequestGrammar | CompileFailure | None:
        """The matcher of a constraint compiled before for this tokenizer, or its refusal as past the deadline; None
        if it must compile (a matcher is made in about a millisecond; the compile can take the whole deadline)."""
        if tokenizer_key(job.describe) != self._tokenizer_key:
            return None
        result = self._new_matcher_or_reason(job, compile_missing=False)
        return None if result is NOT_KNOWN else result

    def _new_matcher_or_reason(self, job: CompileJob, compile_missing: bool = True) -> RequestGrammar | CompileFailure:
        name = field_of(job.constraint)
        if job.wanted is not None and not job.wanted():
            return ENDED
        try:
            return self._new_matcher(job.describe, job.constraint, job.wanted, compile_missing)
        except NotKnown:
            return NOT_KNOWN
        except InvalidConstraint as e:
            return CompileFailure(f"{name}: {e}", invalid=True)
        except CompileTimeout:
            return CompileFailure(f"{name}: grammar too complex: compile exceeded {self.timeout:g} s "
                                  "(--structured-outputs-compile-timeout)", invalid=True)
        except CompileCancelled:
            return ENDED
        except CompileProcessFailed as e:
            return CompileFailure(f"structured_outputs: {e}")

    def _new_matcher(self, describe: executor_pb2.DescribeResponse, constraint: Constraint,
                     wanted: Callable[[], bool] | None = None, compile_missing: bool = True) -> RequestGrammar:
        compiled = self._compile(describe, constraint, wanted, compile_missing)
        import xgrammar  # after _compile: its first call starts the compile process before this import (_info_for)

        matcher = xgrammar.GrammarMatcher(compiled)
        if not first_row_allows_some(matcher, describe.vocab_size):
            raise InvalidConstraint(EMPTY_LANGUAGE)
        return RequestGrammar(matcher)

    def _compile(self, describe: executor_pb2.DescribeResponse, constraint: Constraint,
                 wanted: Callable[[], bool] | None = None, compile_missing: bool = True) -> xgrammar.CompiledGrammar:
        """The constraint compiled for this tokenizer: from the cache, else by the compile process (NotKnown instead
        unless compile_missing; CompileTimeout at once for a constraint that already ran past the deadline)."""
        if not compile_missing:
            return self._cached(constraint)
        info = self._info_for(describe)  # before importing xgrammar: see _info_for
        import xgrammar

        with contextlib.suppress(NotKnown):
            return self._cached(constraint)
        try:
            reply = self._child.compile(describe, constraint, wanted)
        except CompileTimeout:
            self._remember_timeout(constraint)
            raise
        if not reply.ok:
            raise InvalidConstraint(reply.text)
        try:
            compiled = xgrammar.CompiledGrammar.deserialize_json(reply.text, info)
        except (RuntimeError, ValueError) as e:
            raise CompileProcessFailed(f"its compiled grammar did not load: {clean_message(str(e))}") from None
        self._keep(constraint, compiled)
        return compiled

    def _cached(self, constraint: Constraint) -> xgrammar.CompiledGrammar:
        """The constraint's compiled grammar kept for this tokenizer; CompileTimeout if it ran past the deadline
        before, NotKnown if neither."""
        with self._cache_lock:
            found = self._compiled.get(constraint)
            if found is not None:
                self._compiled.move_to_end(constraint)
                return found
            self._refuse_if_timed_out(constraint)
        raise NotKnown()

    def _keep(self, constraint: Constraint, compiled: xgrammar.CompiledGrammar) -> None:
        with self._cache_lock:
            self._compiled[constraint] = compiled
            self._compiled_bytes += compiled.memory_size_bytes
            while len(self._compiled) > 1 and (len(self._compiled) > COMPILED_CACHE_SIZE
                                               or self._compiled_bytes > COMPILED_CACHE_BYTES):
                self._compiled_bytes -= self._compiled.popitem(last=False)[1].memory_size_bytes

    def _refuse_if_timed_out(self, constraint: Constraint) -> None:
        """CompileTimeout for a constraint that already ran past a deadline no longer than the present one."""
        deadline = self._timed_out.get(constraint)
        if deadline is not None and deadline >= self._child.timeout:
            self._timed_out.move_to_end(constraint)
            raise CompileTimeout()

    def _remember_timeout(self, constraint: Constraint) -> None:
        with self._cache_lock:
            if constraint not in self._timed_out:
                self._timed_out_bytes += len(constraint.spec)
            self._timed_out[constraint] = self._child.timeout
            while len(self._timed_out) > 1 and (len(self._timed_out) > TIMED_OUT_SIZE
                                                or self._timed_out_bytes > TIMED_OUT_BYTES):
                self._timed_out_bytes -= len(self._timed_out.popitem(last=False)[0].spec)

    def _info_for(self, describe: executor_pb2.DescribeResponse) -> xgrammar.TokenizerInfo:
        """The tokenizer's xgrammar view (the compiled grammars load against it); a new tokenizer empties the cache."""
        key = tokenizer_key(describe)
        if self._info is not None and key == self._tokenizer_key:
            return self._info
        self._child.begin()  # the compile process imports xgrammar (~3 s) alongside this process, not after it
        import torch
        import xgrammar

        torch.set_num_threads(1)  # xgrammar brings torch into the engine core; no op of it may spin on other cores
        vocab, kind = tokenizer_vocab(describe)
        info = xgrammar.TokenizerInfo(vocab, getattr(xgrammar.VocabType, kind), vocab_size=describe.vocab_size,
                                      stop_token_ids=list(describe.eos_token_ids))
        with self._cache_lock:
            self._compiled.clear()
            self._compiled_bytes = 0
            self._timed_out.clear()
            self._timed_out_bytes = 0
            self._info, self._tokenizer_key = info, key
        return info

    @property
    def processes_killed(self) -> int:
        """Compile processes killed mid-compile (past the deadline, or their request gone)."""
        return self._child.killed

    def close(self) -> None:
        if self._draining is not None:
            self._draining.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._child.close()  # a compile running on the thread ends with it (an idle process may be given back)


ENDED = CompileFailure("structured_outputs: the request ended before its grammar compiled")
NOT_KNOWN = CompileFailure("structured_outputs: not compiled yet")


class NotKnown(Exception):
    """The constraint is in neither cache, and the caller does not compile (GrammarCompiler._known_result)."""


def tokenizer_key(describe: executor_pb2.DescribeResponse) -> tuple[str, int, tuple[int, ...]]:
    return describe.tokenizer_json, describe.vocab_size, tuple(describe.eos_token_ids)
EMPTY_LANGUAGE = "the grammar allows no output: no token of the vocabulary can start it"
DEAD_END = "the output's grammar allows no token here: it can never be completed"


def field_of(constraint: Constraint) -> str:
    """The request field that carries the constraint, as refusals name it."""
    return f"sampling.structured_outputs.{FIELD_NAMES[constraint.kind]}"


def first_row_allows_some(matcher: xgrammar.GrammarMatcher, vocab_size: int) -> bool:
    """Whether a fresh matcher allows any token (EOS included) of the vocabulary: a grammar whose language is empty
    (`root ::= root`, an empty character class) or needs bytes no token has allows none."""
    buffer = np.zeros((1, -(-vocab_size // 32)), dtype=np.int32)
    matcher.fill_next_token_bitmask(torch_view(buffer), 0)
    return row_allows_some(buffer[0], vocab_size)


@dataclass(slots=True)
class StepMasks:
    """A step's token masks (None: no row) and what its constrained requests need besides: refused, id -> why
    (the executor sampled a token the grammar forbids, or xgrammar failed: the server's fault); dead_ends, id -> why
    (the client's grammar allows no token after the output so far: its fault); complete (the grammar accepted EOS,
    which min_tokens did not let end the request: the grammar wins, they finish stopped)."""

    masks: executor_pb2.TokenBitmasks | None = None
    refused: dict[str, str] = field(default_factory=dict)
    dead_ends: dict[str, str] = field(default_factory=dict)
    complete: list[str] = field(default_factory=list)


def step_bitmasks(out: SchedulerOutput, grammars: dict[str, RequestGrammar], vocab_size: int) -> StepMasks:
    """The masks of the step's constrained requests that sample in it (their matchers synced to their output
    first); the requests refused or at a dead end get no mask and must be failed, the complete ones finished."""
    rows = []
    for work in out.scheduled:
        request = work.request
        grammar = grammars.get(request.request_id)
        if (grammar is not None and not request.is_finished
                and request.num_computed_tokens + work.num_tokens >= request.num_tokens):
            rows.append((request, grammar))
    result = StepMasks()
    if not rows:
        return result
    words = -(-vocab_size // 32)
    buffer = np.full((len(rows), words), -1, dtype=np.int32)
    bitmask = torch_view(buffer)
    ids: list[str] = []
    for request, grammar in rows:
        try:
            error = grammar.sync(request.output_token_ids)
            if not error and grammar.matcher.is_terminated():
                result.complete.append(request.request_id)
                continue
            if not error:
                grammar.matcher.fill_next_token_bitmask(bitmask, len(ids))
        except RuntimeError as e:  # xgrammar's checks: one request's matcher must not fail the engine's step
            error = f"the output's grammar failed: {clean_message(str(e))}"
        if error:
            result.refused[request.request_id] = error
            buffer[len(ids)] = -1
            continue
        if not row_allows_some(buffer[len(ids)], vocab_size):
            # A grammar that reached a dead end (one with an empty language is refused before it runs): an empty
            # row would make the executor refuse the whole step, failing every request in it, so only this one fails.
            constraint = request.sampling.constraint
            result.dead_ends[request.request_id] = f"{field_of(constraint)}: {DEAD_END}" if constraint else DEAD_END
            buffer[len(ids)] = -1
            continue
        ids.append(request.request_id)
    if ids:
        data = buffer[:len(ids)].astype("<i4", copy=False).tobytes()
        result.masks = executor_pb2.TokenBitmasks(request_ids=ids, words_per_row=words, bitmask=data)
    return result


def row_allows_some(row: np.ndarray, vocab_size: int) -> bool:
    """Whether a mask row (int32 words) allows any token id below vocab_size (bits past it do not count)."""
    bits = np.unpackbits(row.astype("<i4", copy=False).view(np.uint8), count=vocab_size, bitorder="little")
    return bool(bits.any())


def torch_view(array: np.ndarray) -> Any:
    """The array as the torch tensor xgrammar fills, sharing its memory: no torch operation runs in the engine core
    (its intra-op threads would spin on the cores the executor needs)."""
    import torch

    return torch.from_numpy(array)


def allowed_tokens(masks: executor_pb2.TokenBitmasks, row: int, vocab_size: int) -> np.ndarray:
    """The token ids row `row` of masks allows (for tests and the simulated view)."""
    start = 4 * masks.words_per_row * row
    data = np.frombuffer(masks.bitmask[start:start + 4 * masks.words_per_row], dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(data, bitorder="little")[:vocab_size])
