"""The C++ kernels run on every thread torch is given (#29). Each extension's threads_used probe (an
at::parallel_for compiled with the kernels' flags) must see 2 threads when torch has 2, from the main thread and
from a thread of the executor's kind (the forward thread), and 1 when torch has 1. A build without OpenMP (ATen's
serial fallback) answers 1 and fails this; so does a build linked to a second OpenMP runtime that ignores torch's
thread count. The kernels themselves run on their own pool (kernels/csrc/elastic_pool.h): one per process, sized by
torch's thread count, handing every item of back-to-back regions out once, safe for concurrent callers and after a
fork."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from executor_service.attention import cpu as attention_cpu
from executor_service.model import cpu_ops
from tests.support.procs import ROOT


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probes(name: str = "threads_used") -> list[Callable[..., int]]:
    """The probe `name` of each extension that builds here (threads_used, stolen_items)."""
    found: list[Callable[..., int]] = []
    if attention_cpu.load():
        found.append(getattr(torch.ops.pagedserve_cpu, name))
    if cpu_ops.load():
        found.append(getattr(torch.ops.pagedserve_model, name))
    if not found:
        pytest.skip("the C++ kernels cannot be built here")
    return found


@pytest.mark.usefixtures("two_threads")
def test_every_extension_runs_its_parallel_loops_on_two_threads() -> None:
    for probe in probes():
        assert probe(64) == 2
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as pool:
            assert pool.submit(probe, 64).result() == 2
        assert probe(1) == 1


def test_one_torch_thread_means_one_kernel_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for probe in probes():
            assert probe(64) == 1
    finally:
        torch.set_num_threads(before)


OPENMP_RUNTIMES = """
from pathlib import Path
from tests.executor.test_kernel_threads import probes
probes()
print("\\n".join(sorted({line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                         if any(name in line for name in ("libgomp", "libiomp", "libomp"))})))
"""


def test_the_executors_kernels_bring_no_second_openmp_runtime() -> None:
    """In a fresh process (this one may hold other packages' runtimes, e.g. sentencepiece's bundled libgomp), torch
    and the kernels loaded: one OpenMP runtime."""
    probes()
    if not Path("/proc/self/maps").is_file():
        pytest.skip("no /proc here")
    out = subprocess.run([sys.executable, "-c", OPENMP_RUNTIMES], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    runtimes = out.split()
    assert len(runtimes) == 1, runtimes


@pytest.mark.usefixtures("two_threads")
def test_a_thread_held_up_in_its_share_has_the_rest_of_it_run_by_the_other() -> None:
    """Paged attention and the skinny linear hand out work in shares that a finished thread steals from (#29): while
    the first thread holds its first item (as a preempted thread would), the other runs the rest of its share, and
    every item runs once. A static split (at::parallel_for alone) leaves them to the held thread: 0."""
    for probe in probes("stolen_items"):
        assert probe(64, 10_000) in (31, 32)  # shares [0, 32) and [32, 64)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as pool:
            assert pool.submit(probe, 7, 10_000).result() in (2, 3)  # shares [0, 3) and [3, 7)
        assert probe(1, 10_000) == 0  # one item: one thread, nothing to steal


@pytest.mark.usefixtures("two_threads")
def test_the_kernels_pool_runs_on_every_thread_torch_is_given() -> None:
    for probe in probes("pool_threads_used"):
        assert probe(64) == 2
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward") as pool:
            assert pool.submit(probe, 64).result() == 2
        assert probe(1) == 1
    torch.set_num_threads(1)
    assert all(probe(64) == 1 for probe in probes("pool_threads_used"))


def test_both_extensions_share_one_pool() -> None:
    """Two pools would keep two sets of workers polling for the same cores."""
    addresses = {probe() for probe in probes("pool_address")}
    assert len(addresses) == 1


@pytest.mark.usefixtures("two_threads")
def test_back_to_back_regions_hand_every_item_out_once() -> None:
    """A worker still finishing one region, or waking after it ended, must take nothing of the next."""
    for probe in probes("pool_faulty_regions"):
        assert probe(20_000, 2) == 0
        assert probe(2_000, 37) == 0
        assert probe(3, 70_000) == 0  # more items than a share can count: handed out in groups


@pytest.mark.usefixtures("two_threads")
def test_callers_on_two_threads_at_once_each_get_all_their_items() -> None:
    """The pool runs one caller's region at a time; a second caller meanwhile runs its own alone."""
    probe = probes("pool_faulty_regions")[0]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = [pool.submit(probe, 3_000, 9) for _ in range(3)]
        assert [r.result() for r in results] == [0, 0, 0]


@pytest.mark.usefixtures("two_threads")
def test_an_item_that_throws_fails_its_call_and_not_the_pool() -> None:
    """On a worker the exception would end the process; on the caller it would leave the region running."""
    for probe in probes("pool_rethrows"):
        assert probe(64, 0)  # the caller's first item
        assert probe(64, 63)  # the worker's last
        assert probe(64, 40)


FORKED = textwrap.dedent("""
    import os, sys, torch
    from tests.executor.test_kernel_threads import probes
    torch.set_num_threads(2)
    used, faulty = probes("pool_threads_used")[0], probes("pool_faulty_regions")[0]
    assert used(64) == 2  # the parent's workers run
    child = os.fork()
    if child == 0:
        os._exit(0 if used(64) == 2 and faulty(2_000, 5) == 0 else 3)
    _, status = os.waitpid(child, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
""")


def test_a_forked_child_starts_a_pool_of_its_own() -> None:
    """A child has none of its parent's threads: kept as they were, its pool would count workers that are not there
    and run every region on the caller alone."""
    probes()
    done = subprocess.run([sys.executable, "-c", FORKED], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
