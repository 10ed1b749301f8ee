"""A burst of 2,000 concurrent calls, and a soak of sequential calls: nothing lost, nothing leaked."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path

import grpc
import pytest

from client.lib import PagedServeClient
from tests.support.procs import Stack, child_pids, running_stack, status_bytes

BURST = 2000
# The warm-up fills the collector's first generation (20,000 objects, see scheduler_service/launch.py):
# gRPC leaves a few objects of cyclic garbage per call, collected in batches, so RSS climbs to a plateau first.
# After it, RSS still takes the odd one-time step (the allocator taking another arena; measured: ~0.7-0.9 MB
# once between 8,000 and 12,000 calls, flat before and after, in either process layout), so the soak is
# measured in windows and the smallest growth counts: a leak grows in every window.
# Every process is watched: the engine core, its api server(s) and the executor (whose simulated backend kept ~150
# bytes per request until #27). benchmarks/memory_soak.py runs the same check over 100,000 requests.
# Windows of 1,000 calls (2,500 until the suite's time was cut): the limit is then 100 KB a window, against
# page-sized noise (-4 to +16 KB a window measured after the warm-up) and the executor leak of #27, which,
# put back, failed this test at +123, +229 and +135 B/request.
# The warm-up's first WARM_UP - SOAK calls go WARM_UP_CLIENTS at a time (each client's one after another; the
# plateau needs the calls' garbage, not their order), its last SOAK one after another, as the windows' are: after
# calls side by side alone, RSS went on shrinking by up to 135 B/request a window, enough to hide a leak.
WARM_UP, SOAK, WINDOWS = 4000, 1000, 3
WARM_UP_CLIENTS = 8
MAX_GROWTH_PER_REQUEST = 100  # bytes of RSS, of each process


async def burst(stack: Stack, n: int, max_tokens: int = 16) -> collections.Counter[str]:
    codes: collections.Counter[str] = collections.Counter()

    async def one(client: PagedServeClient) -> None:
        try:
            async for _ in client.generate(prompt_token_ids=[65] * 8, max_tokens=max_tokens, ignore_eos=True):
                pass
            codes["OK"] += 1
        except grpc.aio.AioRpcError as e:
            codes[e.code().name] += 1

    async with PagedServeClient(stack.address) as client:
        await asyncio.gather(*(one(client) for _ in range(n)))
    return codes


@pytest.mark.slow
def test_a_burst_of_2000_calls_is_served_in_full(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "5", "--max-num-seqs", "1024"],
                       ["--max-num-seqs", "1024"]) as stack:
        codes = asyncio.run(burst(stack, BURST))
        assert codes == {"OK": BURST}


@pytest.mark.slow
def test_a_burst_past_the_limits_is_refused_retryably_logged_and_counted(tmp_path: Path) -> None:
    running, queued = 32, 64  # were 64 and 200: the same refusals, a third of the streamed tokens
    with running_stack(tmp_path, ["--simulated", "--sim-step-latency-ms", "5"],
                       ["--max-num-seqs", str(running), "--max-queue-len", str(queued)]) as stack:
        # Requests of 200 steps (1 s or more) hold their places while the burst arrives, however slowly the
        # client sends it: the running and queued places fill, and the rest are refused.
        codes = asyncio.run(burst(stack, BURST, max_tokens=200))
        assert set(codes) == {"OK", "RESOURCE_EXHAUSTED"}, codes
        assert codes["OK"] >= running + queued and sum(codes.values()) == BURST
        assert stack.metrics()["pagedserve:requests_refused_total{RESOURCE_EXHAUSTED}"] == codes["RESOURCE_EXHAUSTED"]
    assert "refused a call with RESOURCE_EXHAUSTED" in (tmp_path / "scheduler.log").read_text()


async def sequential(stack: Stack, n: int) -> None:
    async with PagedServeClient(stack.address) as client:
        for _ in range(n):
            async for _ in client.generate(prompt_token_ids=[65] * 4, max_tokens=2, ignore_eos=True):
                pass


async def side_by_side(stack: Stack, n: int, clients: int) -> None:
    """n calls from `clients` clients at once, each sending its share one call after another."""
    await asyncio.gather(*(sequential(stack, n // clients) for _ in range(clients)))


@pytest.mark.slow
def test_sequential_requests_grow_no_process(tmp_path: Path) -> None:
    with running_stack(tmp_path, ["--simulated"], ["--metrics-port", "-1"]) as stack:
        asyncio.run(side_by_side(stack, WARM_UP - SOAK, WARM_UP_CLIENTS))
        asyncio.run(sequential(stack, SOAK))
        pids = {"engine core": stack.scheduler.pid, "executor": stack.executor.pid}
        pids.update({f"{kind} {pid}": pid for pid, kind in child_pids(stack.scheduler.pid).items()})
        growths: dict[str, list[int]] = {name: [] for name in pids}
        for _ in range(WINDOWS):
            before = {name: status_bytes(pid) for name, pid in pids.items()}
            started = time.monotonic()
            asyncio.run(sequential(stack, SOAK))
            for name, pid in pids.items():
                growths[name].append(status_bytes(pid) - before[name])
                print(f"{name} RSS {before[name] / 1e6:.1f} MB, +{growths[name][-1] / SOAK:.1f} B/request over "
                      f"{SOAK} requests in {time.monotonic() - started:.1f}s")
        assert any(name.startswith("api server") for name in pids)
        for name, grown in growths.items():
            assert min(grown) < MAX_GROWTH_PER_REQUEST * SOAK, (name, [g / SOAK for g in grown])
