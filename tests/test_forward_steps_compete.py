"""benchmarks/forward_steps.py --compete (#29): the competing process takes the CPU it is asked to, none while
stopped, and the amplification says how many times that CPU the team lost."""

from __future__ import annotations

import argparse
import signal
import time

import pytest

from benchmarks import vs_llamacpp
from benchmarks.forward_steps import Compete


def test_burst_and_period_are_parsed_and_checked() -> None:
    assert Compete.parse("1,11") == Compete(1.0, 11.0)
    for bad in ("0,5", "5,5", "6,5", "3", "a,b"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            Compete.parse(bad)


def test_amplification_is_the_lost_cpu_over_the_share_taken() -> None:
    compete = Compete(1.0, 10.0)  # 10% of one core: 5% of a 2-thread team's cores
    assert compete.amplification(1.05, 2) == pytest.approx(1.0)
    assert compete.amplification(1.10, 2) == pytest.approx(2.0)
    assert compete.amplification(1.0, 2) == pytest.approx(0.0)


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
    assert 0.15 <= running <= 0.8  # ~0.5 s; the interpreter's start-up adds some, a busy machine takes some
    assert stopped < 0.02
