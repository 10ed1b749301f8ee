"""What every process of the scheduler service sets up the same way: its log format, its garbage collector and
its open-file limit."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import threading

from client.cpu_cores import parse_cores

log = logging.getLogger("pagedserve.scheduler")
UNLIMITED_TARGET = 1 << 20  # the soft limit sought when the hard one is unlimited


def configure_logging(tag: str = "") -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")


def freeze_startup_objects() -> None:
    """Keep start-up objects out of the collector's way and collect the young generation less often:
    the engine loop allocates many short-lived objects per step."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 1000)


def open_file_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def lower_priority(nice: int) -> None:
    """Raise this process's nice value by `nice` (0: leave it); its threads and children started from now on
    inherit it. The scheduler side's work per step overlaps the executor's forward pass (async scheduling), so on
    cores it shares with the executor's OpenMP team a lower priority lets it run in the team's idle moments instead
    of preempting a team thread that its siblings then wait for at the next barrier (BENCHMARKS.md section 17)."""
    if nice <= 0:
        return
    try:
        now = os.nice(nice)
    except OSError as e:
        log.warning("--cpu-nice %d not applied (%s)", nice, e)
        return
    log.info("scheduler side at nice %d (--cpu-nice %d)", now, nice)


def bind_cores(text: str) -> None:
    """Bind this process (and the threads and children it starts from now on: its api servers) to the cores of
    --cpu-cores `text` ('': leave it where the OS puts it). A core the process may not run on (one the machine does not
    have, or outside its cgroup's cpuset) is an error naming the flag: the kernel drops such cores from the mask
    without a word while one of the others is allowed, so the mask it kept is checked. On cores shared with a CPU
    executor, where its scheduler-side work lands decides which of the executor's threads it preempts (BENCHMARKS.md
    section 17, seventh session)."""
    cores = parse_cores(text)
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:
        raise SystemExit(f"--cpu-cores {text}: cannot bind to those cores ({e})") from None
    kept = os.sched_getaffinity(0)
    if kept != cores:
        dropped = ",".join(map(str, sorted(cores - kept)))
        raise SystemExit(f"--cpu-cores {text}: cannot bind to cores {dropped} (not available to this process)")
    bind_other_threads(cores)
    log.info("scheduler side bound to cores %s (--cpu-cores)", ",".join(map(str, sorted(cores))))


def bind_other_threads(cores: set[int]) -> None:
    """Bind the threads this process already runs besides the calling one (the affinity call binds one thread):
    those native libraries start at import, such as OpenBLAS's pool under numpy, would stay on every core."""
    me = threading.get_native_id()
    with contextlib.suppress(FileNotFoundError):  # no /proc: only the calling thread is bound
        for tid in (int(t) for t in os.listdir("/proc/self/task")):
            if tid != me:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.sched_setaffinity(tid, cores)


def raise_open_file_limit() -> None:
    """Raise this process's soft limit on open files to its hard limit (the common soft 1,024 is a few hundred
    idle connections) and log it; its children inherit it. Where the hard limit is no higher, keep it and log."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("open-file limit stays at %d: raising it to %d failed (%s)", soft, target, e)
            return
        log.info("open-file limit raised from %d to %d (the hard limit)", soft, target)
        return
    log.info("open-file limit is %d (the hard limit)", soft)
