"""The api server's early grammar check (constraints.GrammarCheck): xgrammar's refusals are InvalidArgument naming
the field; a check that runs past its budget passes the constraint on (the engine core compiles it under its own
deadline) and is not run again for the same spec; checks queued behind a slow one are not run at all. The check has
a thread of its own: a schema that took xgrammar 35 s held the tokenizer's thread, and every long prompt, with it.
A real thread; the slow build is one that waits for an event the test sets."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from scheduler_service.core.request import Constraint, ConstraintKind
from scheduler_service.frontend.constraints import GrammarCheck
from scheduler_service.frontend.validation import InvalidArgument
from tests.support.procs import ROOT

SLOW = Constraint(ConstraintKind.REGEX, "slow")


class HeldBuild:
    """to_grammar, except that the constraint SLOW holds its thread until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.built: list[str] = []

    def __call__(self, constraint: Constraint) -> object:
        if constraint == SLOW:
            self.release.wait(30)
        self.built.append(constraint.spec)
        return None


async def test_xgrammar_refusals_name_the_field() -> None:
    check = GrammarCheck()
    with pytest.raises(InvalidArgument) as caught:
        await check.check(Constraint(ConstraintKind.REGEX, "[a-"))
    assert caught.value.field == "sampling.structured_outputs.regex"
    await check.check(Constraint(ConstraintKind.REGEX, "[ab]+"))


async def test_a_slow_check_passes_the_constraint_on_and_is_not_run_again() -> None:
    build = HeldBuild()
    check = GrammarCheck(budget=0.2, build=build)
    try:
        await check.check(SLOW)  # returns after the budget: the engine core's compile decides
        queued = Constraint(ConstraintKind.REGEX, "queued behind the slow one")
        await check.check(queued)  # its thread is busy: passed on after the budget, and cancelled
        await check.check(SLOW)  # remembered: passed on at once, not built again
    finally:
        build.release.set()
    await check.check(Constraint(ConstraintKind.REGEX, "after"))
    assert build.built == ["slow", "after"]


def test_a_check_still_running_does_not_hold_the_process_at_exit() -> None:
    """The check thread is a daemon: a process whose check never ends exits (a pool thread is joined at exit, and a
    costly schema kept an api server from exiting until xgrammar was done)."""
    code = ("import threading\nfrom scheduler_service.frontend.constraints import DaemonWorker\n"
            "DaemonWorker('check').submit(threading.Event().wait)\nprint('leaving')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "leaving\n"), done.stderr[-2000:]
