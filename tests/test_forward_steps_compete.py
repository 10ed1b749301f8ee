"""benchmarks/forward_steps.py --compete (#29): the competing process takes the CPU it is asked to, none while
stopped, does not outlive its benchmark, and the amplification says how many times that CPU the team lost."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import vs_llamacpp
from benchmarks.forward_steps import Compete, Competed
from tests.support.procs import process_gone, wait_until


def test_burst_and_period_are_parsed_and_checked() -> None:
    assert Compete.parse("1,11") == Compete(1.0, 11.0)
    for bad in ("0,5", "5,5", "6,5", "3", "1,inf", "1,nan", "a,b"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            Compete.parse(bad)


def test_amplification_is_the_lost_cpu_over_the_share_taken() -> None:
    # the competitor took 10% of one core: 5% of a 2-thread team's cores
    assert Competed(1.0, 1.05, 0.1).amplification(2) == pytest.approx(1.0)
    assert Competed(1.0, 1.10, 0.1).amplification(2) == pytest.approx(2.0)
    assert Competed(1.0, 1.0, 0.1).amplification(2) == pytest.approx(0.0)
    assert Competed(2.0, 2.2, 0.1).slowdown == pytest.approx(1.1)


def test_the_competitor_burns_its_share_and_nothing_while_stopped() -> None:
    competitor = Compete(5.0, 10.0).start()  # half a core
    try:
        start = vs_llamacpp.cpu_seconds(competitor.pid)
        time.sleep(1.0)  # measuring a rate over a second of wall time, not waiting for an event
        running = vs_llamacpp.cpu_seconds(competitor.pid) - start
        competitor.send_signal(signal.SIGSTOP)
        time.sleep(0.1)
        start = vs_llamacpp.cpu_seconds(competitor.pid)
        time.sleep(0.5)
        stopped = vs_llamacpp.cpu_seconds(competitor.pid) - start
    finally:
        competitor.kill()
        competitor.wait()
    assert 0.1 <= running <= 0.8  # ~0.5 s; a busy machine takes some, the interpreter's start-up adds some
    assert stopped < 0.02


def test_the_competitor_ends_with_its_benchmark() -> None:
    parent = subprocess.run([sys.executable, "-c", "from benchmarks.forward_steps import Compete; "
                             "print(Compete(1.0, 10.0).start().pid)"], capture_output=True, text=True, check=True,
                            cwd=Path(__file__).resolve().parents[1], timeout=60)
    competitor = int(parent.stdout)
    wait_until(lambda: process_gone(competitor), 20.0, "the competitor to end with the process that started it")
