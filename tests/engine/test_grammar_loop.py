"""Structured outputs in the engine loop (#30), in-process against a real simulated executor (byte vocabulary): the
grammar state follows each request's tokens under async scheduling, with the masks following their step (the
executor's deferred_token_bitmask) or, for an executor without it, with the steps run one at a time."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import Constraint, ConstraintKind, FinishReason, Request, SamplingOptions
from scheduler_service.engine.executor_loop import ExecutorLoop
from scheduler_service.engine.grammar_child import IdleProcesses
from scheduler_service.engine.grammar_worker import Compile
from scheduler_service.messages import QueueFull
from tests.support.engine_loop import collect
from tests.support.procs import ROOT

PATTERN = "[a-c]{12}(x|yz)"


@pytest.fixture(scope="module")
def executor_args() -> list[str]:
    return ["--sim-step-latency-ms", "2"]


@pytest.fixture(scope="module")
def idle() -> Iterator[IdleProcesses]:
    """The module's idle compile processes: each test's engine loop takes one (started once, past its import of
    xgrammar and torch, 3-6 s on a loaded 2-core box) and gives it back when it stops between compiles; one killed
    mid-compile (a deadline, a request gone) is replaced by a fresh process, as in the engine core."""
    processes = IdleProcesses()
    yield processes
    processes.close()


def constrained(rid: str, seed: int) -> Request:
    return Request(rid, [65] * 5, SamplingOptions(max_tokens=40, seed=seed,
                                                  constraint=Constraint(ConstraintKind.REGEX, PATTERN)), 0.0)


async def run_three(engine: ExecutorLoop) -> list[tuple[list[int], RequestDelta]]:
    queues: list[asyncio.Queue[RequestDelta]] = [asyncio.Queue() for _ in range(3)]
    engine.add(constrained("c0", 1), queues[0])
    engine.add(constrained("c1", 2), queues[1])
    engine.add(Request("free", [66] * 5, SamplingOptions(max_tokens=20, ignore_eos=True), 0.0), queues[2])
    return list(await asyncio.wait_for(asyncio.gather(*(collect(q) for q in queues)), 60))


def check_constrained(tokens: list[int], last: RequestDelta) -> None:
    assert last.finish_reason is FinishReason.STOPPED, last
    assert tokens[-1] == 2  # the simulated executor's EOS, allowed only once the regex is complete
    assert re.fullmatch(PATTERN, bytes(tokens[:-1]).decode()), tokens


def check(results: list[tuple[list[int], RequestDelta]]) -> None:
    for tokens, last in results[:2]:
        check_constrained(tokens, last)
    assert len(results[2][0]) == 20 and results[2][1].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("deferred", [True, False])
async def test_constrained_requests_follow_their_grammar_under_async_scheduling(
        executor: str, idle: IdleProcesses, deferred: bool) -> None:
    engine = ExecutorLoop(CoreConfig(async_scheduling=True), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    sends: list[tuple[bool, bool]] = []  # (masks inline, masks follow) of each step sent
    real_send = engine.connection.send

    async def spy(out: Any, masks: Any = None, follow: bool = False) -> None:
        sends.append((masks is not None, follow))
        await real_send(out, masks, follow)

    engine.connection.send = spy  # type: ignore[method-assign]
    try:
        assert engine.describe is not None
        if not deferred:
            engine.describe.capabilities.deferred_token_bitmask = False
        check(await run_three(engine))
        if deferred:
            assert any(follow for _, follow in sends), "no step's masks followed it: async scheduling was off"
        else:
            assert not any(follow for _, follow in sends) and any(inline for inline, _ in sends)
        assert not engine._constrained or all(rid not in engine.streams for rid in engine._constrained)
        assert engine._sched().kv.device.num_used == 0
    finally:
        await engine.stop()


async def test_a_loop_stopped_between_compiles_gives_its_compile_process_to_the_next(
        executor: str, idle: IdleProcesses) -> None:
    """Given idle processes (as this module's tests are), an engine loop takes its compile process from them and
    gives it back when it stops between compiles: the next loop compiles on the same process, already started."""
    pids = []
    for rid in ("first", "second"):
        engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
        await engine.start()
        try:
            queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
            engine.add(constrained(rid, 1), queue)
            check_constrained(*await asyncio.wait_for(collect(queue), 60))
            proc = engine.grammar_compiler._child._proc
            assert proc is not None
            pids.append(proc.pid)
        finally:
            await engine.stop()
        assert engine.grammar_compiler._child._proc is None
    assert pids[0] == pids[1]


async def test_a_constraint_that_does_not_compile_ends_the_request_with_its_reason(
        executor: str, idle: IdleProcesses) -> None:
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        bad = Request("bad", [65] * 3, SamplingOptions(constraint=Constraint(ConstraintKind.GRAMMAR, "root ::= (")),
                      0.0)
        engine.add(bad, queue)
        tokens, last = await asyncio.wait_for(collect(queue), 60)
        assert tokens == [] and last.finish_reason is FinishReason.ERROR and "structured_outputs" in last.error
    finally:
        await engine.stop()


async def test_the_grammar_state_survives_an_executor_loss(executor: str, idle: IdleProcesses) -> None:
    """A lost executor means recompute: the requests go back with their outputs, and the matchers, which follow the
    outputs, go on where they were; the constrained outputs still match."""
    from scheduler_service.engine.executor_link import ExecutorLost

    engine = ExecutorLoop(CoreConfig(async_scheduling=True), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    real_receive = engine.connection.receive
    calls = {"n": 0}

    async def lose_once(out: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 6:
            engine.connection.drop_stream()
            raise ExecutorLost("injected")
        return await real_receive(out)

    engine.connection.receive = lose_once  # type: ignore[method-assign]
    try:
        check(await run_three(engine))
        assert calls["n"] > 6
    finally:
        await engine.stop()


async def test_a_grammar_at_a_dead_end_fails_alone_as_the_clients_error(executor: str, idle: IdleProcesses) -> None:
    """A grammar that reaches a dead end (`"a"`, then a rule whose language is empty) gives an all-zero mask row;
    sent, it makes the executor refuse the whole step, failing every other client's request in it. Only that
    request fails, with an error naming its field (the api server answers INVALID_ARGUMENT / 400)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    try:
        warm: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("warm", 1), warm)  # xgrammar loaded and the compiler built before the race below
        assert (await asyncio.wait_for(collect(warm), 60))[1].finish_reason is FinishReason.STOPPED
        finished: list[str] = []

        async def run(rid: str, queue: asyncio.Queue[RequestDelta]) -> tuple[list[int], RequestDelta]:
            result = await collect(queue)
            finished.append(rid)
            return result

        free: asyncio.Queue[RequestDelta] = asyncio.Queue()
        bad: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("free", [66] * 5, SamplingOptions(max_tokens=300, ignore_eos=True), 0.0), free)
        engine.add(Request("bad", [65] * 3, SamplingOptions(
            max_tokens=10, constraint=Constraint(ConstraintKind.GRAMMAR, DEAD_END)), 0.0), bad)
        (free_tokens, free_last), (bad_tokens, bad_last) = await asyncio.wait_for(
            asyncio.gather(run("free", free), run("bad", bad)), 60)
        assert free_last.finish_reason is FinishReason.LENGTH and len(free_tokens) == 300, free_last
        assert bad_tokens == [ord("a")] and bad_last.finish_reason is FinishReason.ERROR
        assert bad_last.error.startswith("sampling.structured_outputs.grammar: the output's grammar allows no token "
                                         "here"), bad_last.error
        assert finished == ["bad", "free"]  # the bad one shared steps with the free one
    finally:
        await engine.stop()


DEAD_END = 'root ::= "a" r\nr ::= r'
"""Its first token is forced ("a"), after which no token (not even EOS) is allowed."""


@pytest.mark.parametrize(("kind", "spec"), [(ConstraintKind.GRAMMAR, "root ::= root"),
                                            (ConstraintKind.REGEX, "[^\\x00-\\U0010FFFF]")])
async def test_a_grammar_whose_language_is_empty_is_refused_before_it_runs(
        executor: str, idle: IdleProcesses, kind: ConstraintKind,
                                                                            spec: str) -> None:
    """xgrammar compiles both; their first mask allows no token. Refused at the compile (the client's fault, named),
    never scheduled: it used to run and fail as the server's error ("generation failed", HTTP 500)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("empty", [65] * 3, SamplingOptions(max_tokens=10, constraint=Constraint(kind, spec)),
                           0.0), queue)
        tokens, last = await asyncio.wait_for(collect(queue), 60)
        assert tokens == [] and last.finish_reason is FinishReason.ERROR
        name = "grammar" if kind is ConstraintKind.GRAMMAR else "regex"
        assert last.error == (f"sampling.structured_outputs.{name}: the grammar allows no output: no token of the "
                              "vocabulary can start it"), last.error
    finally:
        await engine.stop()


async def test_requests_waiting_for_their_grammar_count_against_the_queue_limit(
        executor: str, idle: IdleProcesses) -> None:
    """A constrained request waits outside the scheduler while its grammar compiles (each distinct spec up to the
    compile deadline); those requests did not count against --max-queue-len, so a client could queue any number of
    them behind the one compile process. They count from add() (no await between the adds here: none has compiled)
    until they join the scheduler or end."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=2, grammar_processes=idle)
    await engine.start()
    try:
        queues: list[asyncio.Queue[RequestDelta]] = [asyncio.Queue() for _ in range(3)]
        engine.add(constrained("c0", 1), queues[0])
        engine.add(constrained("c1", 2), queues[1])
        assert engine.load()[1] == 2
        with pytest.raises(QueueFull):
            engine.add(constrained("c2", 3), queues[2])
        for tokens, last in await asyncio.wait_for(asyncio.gather(*(collect(q) for q in queues[:2])), 60):
            assert last.finish_reason is FinishReason.STOPPED, last  # admitted ones compile and run
            assert re.fullmatch(PATTERN, bytes(tokens[:-1]).decode()), tokens
        assert engine.load()[1] == 0
        engine.add(constrained("c3", 4), queues[2])
        engine.abort("c3")  # ended while it waits for its compile: no longer counted
        assert engine.load()[1] == 0
    finally:
        await engine.stop()


async def test_min_tokens_does_not_outlive_a_complete_grammar(executor: str, idle: IdleProcesses) -> None:
    """min_tokens keeps EOS from ending a request; once the grammar has accepted EOS its matcher is terminated and
    xgrammar raises on the next mask fill, which failed the engine's whole step (every request recomputed, this one
    an internal error). The grammar wins: the request ends stopped, its document complete."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("short", [65] * 3, SamplingOptions(
            max_tokens=20, min_tokens=10, constraint=Constraint(ConstraintKind.REGEX, "ab")), 0.0), queue)
        tokens, last = await asyncio.wait_for(collect(queue), 60)
        assert last.finish_reason is FinishReason.STOPPED, last
        assert tokens == [ord("a"), ord("b"), 2]
    finally:
        await engine.stop()


async def test_a_request_that_ends_while_its_grammar_waits_is_not_compiled(executor: str, idle: IdleProcesses) -> None:
    """Compiles run one at a time; a client that sends a costly spec and gives up must not leave its compile in the
    queue, holding every later constrained request behind it. An ended request's compile is skipped."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    compiled: list[str] = []  # what reached the compile process
    child = engine.grammar_compiler._child
    real_compile = child.compile

    def spy(describe: Any, constraint: Constraint, wanted: Any = None) -> Any:
        compiled.append(constraint.spec)
        return real_compile(describe, constraint, wanted)

    child.compile = spy  # type: ignore[method-assign]
    try:
        first: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("first", 1), first)
        await asyncio.sleep(0)  # its batch goes to the compile thread; the next request is a batch of its own
        gone: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("gone", [65] * 3, SamplingOptions(
            max_tokens=10, constraint=Constraint(ConstraintKind.REGEX, "[x-z]{3}")), 0.0), gone)
        engine.abort("gone")
        after: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("after", [65] * 3, SamplingOptions(
            max_tokens=10, constraint=Constraint(ConstraintKind.REGEX, "[p-r]{3}")), 0.0), after)
        for queue, pattern in ((first, PATTERN), (after, "[p-r]{3}")):
            tokens, last = await asyncio.wait_for(collect(queue), 60)
            assert last.finish_reason is FinishReason.STOPPED, last
            assert re.fullmatch(pattern, bytes(tokens[:-1]).decode()), tokens
        assert compiled == [PATTERN, "[p-r]{3}"]  # not "[x-z]{3}"
    finally:
        await engine.stop()


async def test_compiled_grammars_kept_are_bounded_in_bytes(
        executor: str, idle: IdleProcesses, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled grammars are big (a 60 KB regex: ~40 MB on a 2k vocabulary); a count of 256 alone let one client
    fill the engine core's memory with distinct specs, and xgrammar's compiler kept its own unbounded copy of each."""
    from scheduler_service.engine import grammar

    # every compiled grammar is more than 1 byte: only the newest stays
    monkeypatch.setattr(grammar, "COMPILED_CACHE_BYTES", 1, raising=False)
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    try:
        for i, pattern in enumerate(("[a-c]{5}", "[d-f]{5}", "[g-i]{5}")):
            queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
            engine.add(Request(f"r{i}", [65] * 3, SamplingOptions(
                max_tokens=10, constraint=Constraint(ConstraintKind.REGEX, pattern)), 0.0), queue)
            tokens, last = await asyncio.wait_for(collect(queue), 60)
            assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(pattern, bytes(tokens[:-1]).decode())
        compiler = engine.grammar_compiler
        assert [c.spec for c in compiler._compiled] == ["[g-i]{5}"]
    finally:
        await engine.stop()


async def test_callers_take_turns_at_the_compile_thread(executor: str, idle: IdleProcesses) -> None:
    """One caller's queued specs hold another caller's constrained request for at most the compile already
    running (found by an attack: six costly specs of one API key held another key's small request 21 s)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    compiled: list[str] = []  # what reached the compile process, in order
    running, go_on = threading.Event(), threading.Event()
    child = engine.grammar_compiler._child
    real_compile = child.compile

    def spy(describe: Any, constraint: Constraint, wanted: Any = None) -> Any:
        compiled.append(constraint.spec)
        running.set()
        go_on.wait(30)  # the first compile lasts until the other caller's request is queued
        return real_compile(describe, constraint, wanted)

    child.compile = spy  # type: ignore[method-assign]
    patterns = {"a0": "[a-c]{3}", "a1": "[d-f]{3}", "a2": "[g-i]{3}", "b0": "[p-r]{3}"}
    queues = {rid: asyncio.Queue[RequestDelta]() for rid in patterns}

    def add(rid: str) -> None:
        engine.add(Request(rid, [65] * 3, SamplingOptions(
            max_tokens=10, constraint=Constraint(ConstraintKind.REGEX, patterns[rid])), 0.0, owner=rid[0]),
            queues[rid])

    try:
        for rid in ("a0", "a1", "a2"):
            add(rid)
        await asyncio.to_thread(running.wait, 30)
        add("b0")
        while len(engine.grammar_compiler._queue) < 3:  # a1, a2 and b0 queued behind a0's running compile
            await asyncio.sleep(0)
        go_on.set()
        for rid, queue in queues.items():
            tokens, last = await asyncio.wait_for(collect(queue), 60)
            assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(patterns[rid], bytes(tokens[:-1])
                                                                               .decode()), (rid, tokens)
        assert compiled == [patterns[r] for r in ("a0", "b0", "a1", "a2")]
    finally:
        go_on.set()
        await engine.stop()


async def test_another_callers_request_added_in_the_same_turn_does_not_wait_for_the_others_compiles(
        executor: str, idle: IdleProcesses) -> None:
    """A front-end sends the requests it took in one turn of its event loop as one message, and the engine core adds
    them in one turn: a constrained request of one caller must join the scheduler once its own grammar compiled,
    not once every grammar added with it did (found by an attack: key A's costly specs, sent with key B's small
    one, held B's request for all of A's compiles, whatever the order the compile thread served them in)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    go_on = threading.Event()
    child = engine.grammar_compiler._child
    real_compile = child.compile
    patterns = {"a0": "[a-c]{3}", "a1": "[d-f]{3}", "b0": "[p-r]{3}"}

    def spy(describe: Any, constraint: Constraint, wanted: Any = None) -> Any:
        if constraint.spec == patterns["a1"]:
            go_on.wait(30)  # A's second compile lasts until B's request has finished
        return real_compile(describe, constraint, wanted)

    child.compile = spy  # type: ignore[method-assign]
    queues = {rid: asyncio.Queue[RequestDelta]() for rid in patterns}
    try:
        for rid in ("a0", "a1", "b0"):  # one turn: one compile batch
            engine.add(Request(rid, [65] * 3, SamplingOptions(
                max_tokens=10, constraint=Constraint(ConstraintKind.REGEX, patterns[rid])), 0.0, owner=rid[0]),
                queues[rid])
        tokens, last = await asyncio.wait_for(collect(queues["b0"]), 20)
        assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(patterns["b0"], bytes(tokens[:-1]).decode())
        assert not go_on.is_set()
        go_on.set()
        for rid in ("a0", "a1"):
            tokens, last = await asyncio.wait_for(collect(queues[rid]), 60)
            assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(patterns[rid], bytes(tokens[:-1])
                                                                               .decode()), (rid, tokens)
    finally:
        go_on.set()
        await engine.stop()


async def test_the_sequences_of_one_call_join_the_scheduler_together(executor: str, idle: IdleProcesses) -> None:
    """Compiled per call, the n > 1 sequences of one call (share_prompt_with its first) still join as one group."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    joined: dict[asyncio.Task[Any] | None, list[str]] = {}  # by the task that added them
    real_add = engine._sched().add_request

    def spy(request: Request, front: bool = False) -> None:
        joined.setdefault(asyncio.current_task(), []).append(request.request_id)
        real_add(request, front)

    engine._sched().add_request = spy  # type: ignore[method-assign]
    options = SamplingOptions(max_tokens=10, seed=1, constraint=Constraint(ConstraintKind.REGEX, "[a-c]{3}"))
    queues = {rid: asyncio.Queue[RequestDelta]() for rid in ("x#0", "x#1", "x#2", "y")}
    try:
        for rid, queue in queues.items():
            share = "x#0" if rid in ("x#1", "x#2") else None
            engine.add(Request(rid, [65] * 3, options, 0.0, share_prompt_with=share, owner=rid[0]), queue)
        for queue in queues.values():
            _, last = await asyncio.wait_for(collect(queue), 60)
            assert last.finish_reason is FinishReason.STOPPED
        assert ["x#0", "x#1", "x#2"] in joined.values()
    finally:
        await engine.stop()


SLOW_SCHEMA = '{"type": "string", "pattern": "[a-z]{1,30000}"}'
"""xgrammar expands a schema pattern's repetitions: this one takes minutes to turn into a grammar (6,000: 3 s,
growing faster than its square). The api servers refuse it (MAX_PATTERN_REPEATS); the engine core must bound it
whoever sends it."""


def slow_request(rid: str, owner: str = "") -> Request:
    return Request(rid, [65] * 3, SamplingOptions(max_tokens=10, constraint=Constraint(
        ConstraintKind.JSON_SCHEMA, SLOW_SCHEMA)), 0.0, owner=owner)


async def test_a_compile_past_its_deadline_is_killed_and_the_request_refused_as_invalid(
        executor: str, idle: IdleProcesses) -> None:
    """The compile runs in a process of its own: past --structured-outputs-compile-timeout it is killed, the
    request ends as its client's fault (INVALID_ARGUMENT / 400 naming the field), and the next compile gets a
    fresh process. Before, the compile held the engine core's one compile thread until it ended, minutes."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_compile_timeout=1.0,
                          grammar_processes=idle)
    await engine.start()
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        stream = engine.add(slow_request("slow"), queue)
        tokens, last = await asyncio.wait_for(collect(queue), 60)
        assert tokens == [] and last.finish_reason is FinishReason.ERROR, last
        assert last.error == ("sampling.structured_outputs.json: grammar too complex: compile exceeded 1 s "
                              "(--structured-outputs-compile-timeout)"), last.error
        assert stream.invalid_argument
        assert engine.grammar_compiler.processes_killed == 1
        engine.grammar_compiler._child.timeout = 600.0  # the next compile's outcome must not depend on the box's load
        after: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("after", 3), after)
        tokens, last = await asyncio.wait_for(collect(after), 120)
        assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(PATTERN, bytes(tokens[:-1]).decode())
    finally:
        await engine.stop()


async def test_a_resent_spec_that_ran_past_the_deadline_is_refused_without_a_compile(
        executor: str, idle: IdleProcesses) -> None:
    """A constraint whose compile timed out is remembered: resent (by anyone), it is refused at once with the same
    error and never reaches the compile process, which each resend used to hold for the whole deadline. A longer
    deadline (here set on the process handle) compiles it again."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_compile_timeout=1.0,
                          grammar_processes=idle)
    await engine.start()
    child = engine.grammar_compiler._child
    sent: list[str] = []
    real_compile = child.compile

    def spy(describe: Any, constraint: Constraint, wanted: Any = None) -> Any:
        sent.append(constraint.spec)
        return real_compile(describe, constraint, wanted)

    child.compile = spy  # type: ignore[method-assign]
    try:
        errors = []
        for rid, owner in (("first", "a"), ("again", "a"), ("other", "b")):
            queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
            stream = engine.add(slow_request(rid, owner), queue)
            tokens, last = await asyncio.wait_for(collect(queue), 60)
            assert tokens == [] and last.finish_reason is FinishReason.ERROR and stream.invalid_argument, last
            errors.append(last.error)
        assert errors == ["sampling.structured_outputs.json: grammar too complex: compile exceeded 1 s "
                          "(--structured-outputs-compile-timeout)"] * 3
        assert sent == [SLOW_SCHEMA] and child.killed == 1
        child.timeout = 2.0  # a longer deadline than the one it ran past: compiled again (and killed again)
        queue = asyncio.Queue()
        engine.add(slow_request("longer"), queue)
        _, last = await asyncio.wait_for(collect(queue), 60)
        assert last.finish_reason is FinishReason.ERROR and sent == [SLOW_SCHEMA] * 2 and child.killed == 2
    finally:
        await engine.stop()


async def test_a_grammar_compiled_before_does_not_wait_behind_a_compile_running(
        executor: str, idle: IdleProcesses) -> None:
    """A constraint already compiled (or already past the deadline) is answered at once, not queued behind another
    caller's costly compile: such a request used to wait up to the whole deadline (9.6 - 23 s behind a 35 s schema)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_compile_timeout=600.0,
                          grammar_processes=idle)
    await engine.start()
    try:
        first: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("compiled", 1), first)
        check_constrained(*await asyncio.wait_for(collect(first), 120))
        slow: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(slow_request("slow", owner="a"), slow)  # compiles for far longer than the rest of this test
        again: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("again", 2), again)
        check_constrained(*await asyncio.wait_for(collect(again), 60))
        assert slow.empty() and engine.streams["slow"].grammar is None  # still compiling
        engine.abort("slow")
    finally:
        await engine.stop()


async def test_a_compile_whose_request_ends_is_killed_and_frees_the_compile_queue(
        executor: str, idle: IdleProcesses) -> None:
    """A client that sends a costly spec and leaves while it compiles takes its compile with it: the process is
    killed, and the next caller's constrained request compiles at once (with a deadline of 10 minutes, only the
    kill can end the first compile within the test's wait)."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_compile_timeout=600.0,
                          grammar_processes=idle)
    await engine.start()
    child = engine.grammar_compiler._child
    running = threading.Event()
    real_compile = child.compile

    def spy(describe: Any, constraint: Constraint, wanted: Any = None) -> Any:
        if constraint.spec == SLOW_SCHEMA:
            running.set()
        return real_compile(describe, constraint, wanted)

    child.compile = spy  # type: ignore[method-assign]
    try:
        slow: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(slow_request("slow", owner="a"), slow)
        await asyncio.to_thread(running.wait, 60)
        after: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(Request("after", [65] * 5, SamplingOptions(max_tokens=40, seed=1, constraint=Constraint(
            ConstraintKind.REGEX, PATTERN)), 0.0, owner="b"), after)
        engine.abort("slow")
        tokens, last = await asyncio.wait_for(collect(after), 120)
        assert last.finish_reason is FinishReason.STOPPED and re.fullmatch(PATTERN, bytes(tokens[:-1]).decode())
        assert child.killed == 1
        assert not engine.holds("slow")
    finally:
        await engine.stop()


@pytest.mark.parametrize("first", [True, False], ids=["before the first compile", "between compiles"])
async def test_a_compile_process_that_died_before_a_compile_is_replaced_once(
        executor: str, idle: IdleProcesses, first: bool) -> None:
    """The compile process is killed before a constrained request's compile: the one begin() started (nothing read
    from it yet), or the one that compiled the request before (its order then meets a broken pipe). The compile
    runs on a fresh process instead of failing with "structured_outputs: ... died" (or "Broken pipe")."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=None if first else idle)
    await engine.start()
    child = engine.grammar_compiler._child
    try:
        if first:
            child.begin()
        else:
            before: asyncio.Queue[RequestDelta] = asyncio.Queue()
            engine.add(Request("before", [65] * 5, SamplingOptions(max_tokens=40, seed=1, constraint=Constraint(
                ConstraintKind.REGEX, "[d-f]{12}(x|yz)")), 0.0), before)
            tokens, last = await asyncio.wait_for(collect(before), 120)
            assert last.finish_reason is FinishReason.STOPPED and re.fullmatch("[d-f]{12}(x|yz)",
                                                                             bytes(tokens[:-1]).decode()), last
        dead = child._proc
        assert dead is not None
        dead.kill()
        dead.wait()
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("next", 1), queue)
        check_constrained(*await asyncio.wait_for(collect(queue), 120))
        assert child._proc is not None and child._proc.pid != dead.pid
    finally:
        await engine.stop()


async def test_a_compile_process_that_dies_after_the_order_reached_it_fails_that_compile_alone(
        executor: str, idle: IdleProcesses) -> None:
    """A process that dies once it has the order (a crash in xgrammar, which the constraint may have caused) is not
    retried: the request fails naming structured_outputs, and the next compile gets a fresh process."""
    engine = ExecutorLoop(CoreConfig(), executor, max_queue_len=100, grammar_processes=idle)
    await engine.start()
    child = engine.grammar_compiler._child
    real_send = child._send
    orders: list[str] = []

    def send_then_die(order: Any) -> None:
        proc = child._proc
        first = isinstance(order, Compile) and not orders and proc is not None
        if first and proc is not None:  # stopped first: it cannot answer between the order and the kill
            os.kill(proc.pid, signal.SIGSTOP)
        real_send(order)
        if isinstance(order, Compile):
            orders.append(order.spec)
        if first and proc is not None:
            proc.kill()
            proc.wait()

    child._send = send_then_die  # type: ignore[method-assign]
    try:
        queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("crashes", 1), queue)
        tokens, last = await asyncio.wait_for(collect(queue), 120)
        assert tokens == [] and last.finish_reason is FinishReason.ERROR, last
        assert "structured_outputs: the grammar compile process died" in last.error and orders == [PATTERN]
        after: asyncio.Queue[RequestDelta] = asyncio.Queue()
        engine.add(constrained("after", 2), after)
        check_constrained(*await asyncio.wait_for(collect(after), 120))
        assert orders == [PATTERN, PATTERN]
    finally:
        await engine.stop()


def test_the_first_compile_starts_the_process_before_the_engine_core_imports_xgrammar() -> None:
    """CompileChild.begin's point: both ~3 s imports run side by side. In a fresh interpreter (nothing imported yet)
    the first compile's spawn must find xgrammar not yet imported by the engine core's own compile path."""
    code = """if True:
        import sys
        from protos.pagedserve.v1 import executor_pb2
        from scheduler_service.core.request import Constraint, ConstraintKind
        from scheduler_service.engine import grammar, grammar_child
        seen = []
        def spawn():
            seen.append("xgrammar" in sys.modules)
            raise KeyboardInterrupt
        grammar_child.spawn = spawn
        try:
            compiler = grammar.GrammarCompiler()
            compiler._new_matcher(executor_pb2.DescribeResponse(), Constraint(ConstraintKind.JSON_OBJECT))
        except KeyboardInterrupt:
            pass
        print(seen)
    """
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[False]", (done.stdout, done.stderr[-2000:])
