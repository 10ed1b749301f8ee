"""The C++ kernels run on every thread torch is given (#29): each extension's threads_used probe (an
at::parallel_for compiled with the kernels' flags) must see 2 threads when torch has 2, from the main thread and
from a thread of the executor's kind (the forward thread), and 1 when torch has 1. A build without OpenMP (ATen's
serial fallback) answers 1 and fails this; so does a build linked to a second OpenMP runtime that ignores torch's
thread count."""

from __future__ import annotations

import subprocess
import sys
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
