"""Where the executor computes on the CPU (#29): the cores it is bound to (--cpu-cores, as vLLM's
VLLM_CPU_OMP_THREADS_BIND) and the threads of its forward pass (--cpu-threads). torch's intra-op pool, the C++
kernels' at::parallel_for, MKL and oneDNN all run on one OpenMP pool (torch's libgomp), so one thread count sizes
them all; nothing else in the executor computes in parallel, so there is no second pool to oversubscribe the cores.

Default: one thread per core this process may run on (its affinity mask, capped by a cgroup v2 CPU quota as
`docker run --cpus` sets), so a container or `taskset` that gives the executor N cores gets N threads."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from pathlib import Path

log = logging.getLogger("pagedserve.executor")
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def parse_cores(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}; raises ValueError on anything else."""
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if low < 0 or high < low:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        cores.update(range(low, high + 1))
    if not cores:
        raise ValueError(f"no cores in {text!r}")
    return cores


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


def omp_environment(requested: str, spin_count: int, cpu_cores: str) -> dict[str, str]:
    """The OpenMP environment for --cpu-omp-wait-policy `requested` and --cpu-omp-spin-count `spin_count` (-1: by the
    policy). auto leaves an environment that already sets either variable alone; else, without --cpu-cores (cores
    shared with the scheduler side and the executor's event loop), passive, and with --cpu-cores (the operator's
    cores for the executor alone) libgomp's default: spin ~300,000 times (about 7 ms here) after a region, then
    sleep. A spinning thread holds a core that another runnable thread wants; on a loaded 2-core box each parallel
    region then waited milliseconds for the team, where a sleeping one costs a futex wake (BENCHMARKS.md 17)."""
    env: dict[str, str] = {}
    if requested != "auto":
        env["OMP_WAIT_POLICY"] = requested.upper()
    elif not any(os.environ.get(name) for name in OMP_VARIABLES) and not cpu_cores:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
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
    """Bind the calling thread (and the threads it starts from now on) to `cpu_cores` ('' : leave it as it is)."""
    if cpu_cores:
        os.sched_setaffinity(0, parse_cores(cpu_cores))


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
