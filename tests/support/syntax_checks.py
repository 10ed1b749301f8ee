"""`g++ -fsyntax-only -march=x86-64-v3` over every C++ kernel source, in the background (a pytest plugin:
tests/conftest.py loads it).

Each check parses torch's headers alone, ~7 s of one core, and one pytest process mostly keeps one core busy: once
collection shows a test that uses the `syntax_checks` fixture (tests/executor/test_attention_cpu.py), every check
starts at once at the lowest priority, so they take the core the tests leave idle; each test then waits for its
own source's result. Under pytest-xdist (scripts/test.sh) every worker collects every test, so there the checks
start with the first test that asks for them, in the worker that runs it, at normal priority (that test waits for
them, and niced they would starve behind the other worker's processes). Whatever still runs when the session
ends is killed.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

FIXTURE = "syntax_checks"


class SyntaxChecks:
    """One background syntax check per source, started together."""

    def __init__(self) -> None:
        self.procs: dict[Path, subprocess.Popen[str]] = {}

    def start(self, niceness: int) -> None:
        command = compile_command()
        for source in sources():
            self.procs[source] = subprocess.Popen(["nice", "-n", str(niceness), *command, str(source)],
                                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def result(self, source: Path, timeout: float = 300.0) -> tuple[int, str]:
        """The check's exit status and the end of its stderr."""
        proc = self.procs[source]
        _, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stderr[-2000:]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


def sources() -> list[Path]:
    from executor_service.attention import cpu
    from executor_service.model import cpu_ops

    return [cpu.SOURCE, *cpu_ops.SOURCES]


def compile_command() -> list[str]:
    """A build for a CPU without AVX-512 (x86-64-v3), warnings as the kernels' builds treat them."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from executor_service.kernels import build as cpu_build

    includes = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]  # torch's own warnings
    includes.append(f"-I{cpu_build.SHARED_HEADERS}")
    return [os.environ.get("CXX", "g++"), "-std=c++17", "-march=x86-64-v3", "-fopenmp-simd", "-Wall",
            "-Werror=unused-parameter", "-fsyntax-only", *includes]


CHECKS = pytest.StashKey[SyntaxChecks]()


def is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_finish(session: pytest.Session) -> None:
    if is_xdist_worker(session.config):  # every worker collects every test: the one that runs them starts them
        return
    if any(FIXTURE in getattr(item, "fixturenames", ()) for item in session.items):
        checks = session.config.stash[CHECKS] = SyntaxChecks()
        checks.start(niceness=19)


def pytest_sessionfinish(session: pytest.Session) -> None:
    checks = session.config.stash.get(CHECKS, None)
    if checks is not None:
        checks.stop()


@pytest.fixture(scope="session")
def syntax_checks(request: pytest.FixtureRequest) -> SyntaxChecks:
    """The checks started after collection (started here when a test asks for them otherwise, as on an xdist
    worker)."""
    stash = request.config.stash
    if CHECKS not in stash:
        stash[CHECKS] = SyntaxChecks()
        stash[CHECKS].start(niceness=0)
    return stash[CHECKS]
