"""Where the executor computes on the CPU (#29): the cores it is bound to (--cpu-cores, as vLLM's
VLLM_CPU_OMP_THREADS_BIND) and the threads of its forward pass (--cpu-threads). The C++ kernels run on their own
pool (executor_service/kernels/csrc/elastic_pool.h: a region ends when its items are done, without waiting for a
thread the OS kept off its core); torch's intra-op ops, MKL and oneDNN on torch's OpenMP team. torch's thread count
sizes both, and the two take turns: each polls only briefly (the pool yielding its core as it polls, the OpenMP team
AUTO_SPIN_COUNT times under auto) before it sleeps, so neither holds a core the other needs.

Default: one thread per core this process may run on (its affinity mask, capped by a cgroup v2 CPU quota as
`docker run --cpus` sets), so a container or `taskset` that gives the executor N cores gets N threads."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
from pathlib import Path

from client.cpu_cores import parse_cores

log = logging.getLogger("pagedserve.executor")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def lower_thread_priority() -> None:
    """Give this thread (and the threads it starts) the lowest CPU priority, where the OS lets it (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask, capped by the cgroup's CPU quota (rounded up)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_quota()
    return max(1, min(count, math.ceil(quota)) if quota is not None else count)


def cgroup_quota() -> float | None:
    """The cgroup v2 CPU limit in cores ('200000 100000' -> 2.0); None when unlimited or unknown."""
    with contextlib.suppress(OSError, ValueError):
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
        if quota != "max":
            return int(quota) / int(period)
    return None


OMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


AUTO_SPIN_COUNT = 10_000  # polls before an idle OpenMP thread sleeps under auto: 10 - 40 us on the benchmark box


def omp_environment(requested: str, spin_count: int) -> dict[str, str]:
    """The OpenMP environment for --cpu-omp-wait-policy `requested` and --cpu-omp-spin-count `spin_count` (-1: the
    policy's). auto: an idle thread polls AUTO_SPIN_COUNT times before it sleeps: the kernels' own pool runs the
    decode steps' regions, so OpenMP's team serves torch's GEMMs and ops, and a team that polled for milliseconds
    after them held the cores the pool then needed (the 128-request benchmark at 2 threads: 4 - 8% faster than
    300,000 polls, BENCHMARKS.md section 17, twenty-first session). An OMP_WAIT_POLICY or GOMP_SPINCOUNT already in
    the environment is kept under auto. passive suits cores shared with other busy processes: a polling
    thread holds a core another runnable thread wants."""
    env: dict[str, str] = {}
    if requested != "auto":
        env["OMP_WAIT_POLICY"] = requested.upper()
    elif spin_count < 0 and not any(os.environ.get(name) for name in OMP_VARIABLES):
        spin_count = AUTO_SPIN_COUNT
    if spin_count >= 0:
        env["GOMP_SPINCOUNT"] = str(spin_count)
    return env


def set_omp_environment(env: dict[str, str]) -> bool:
    """Set `env` for the OpenMP runtime torch loads; False (and a warning) if torch is loaded already, since libgomp
    reads it once, when it starts."""
    import sys

    if not env:
        return True
    if "torch" in sys.modules:
        log.warning("OpenMP settings %s ignored: torch is already loaded", env)
        return False
    os.environ.update(env)
    log.info("OpenMP: %s", " ".join(f"{k}={v}" for k, v in env.items()))
    return True


def bind_cores(cpu_cores: str) -> None:
    """Bind the calling thread (and the threads it starts from now on) to `cpu_cores` (client/cpu_cores.py's syntax,
    checked by ExecutorConfig.from_args; blank: leave it as it is)."""
    cores = parse_cores(cpu_cores)
    if cores:
        os.sched_setaffinity(0, cores)


def place(cpu_threads: int, cpu_cores: str) -> int:
    """Bind this process (and the threads it starts from now on) to `cpu_cores` if given, then size torch's pool to
    `cpu_threads` (0: usable_cores()); returns the thread count. Call before the first forward pass."""
    import torch

    if cpu_threads < 0:
        raise ValueError(f"--cpu-threads must be >= 0, got {cpu_threads}")
    bind_cores(cpu_cores)
    threads = cpu_threads or usable_cores()
    torch.set_num_threads(threads)
    log.info("CPU placement: %d forward threads%s", threads, f" on cores {cpu_cores}" if cpu_cores else "")
    return threads
