"""Several executors behind one scheduler, found through a dns:/// name whose addresses change at run time."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import generation_pb2
from tests.e2e.test_production import serving
from tests.support.pool_procs import Pool, running_pool
from tests.support.procs import ROOT, generate_all, stop, wait_until

SIM = ["--simulated", "--sim-step-latency-ms", "5", "--num-gpu-blocks", "1024", "--num-cpu-blocks", "64"]
NUM, MAX_TOKENS = 120, 40
LENGTH = generation_pb2.FINISH_REASON_LENGTH


def steps(pool: Pool) -> dict[str, float]:
    return pool.per_executor("pagedserve:executor_step_seconds_count")


def assert_idle(pool: Pool) -> None:
    wait_until(lambda: sum(pool.per_executor("pagedserve:executor_num_requests_running").values()) == 0,
               what="no request running")
    m = pool.metrics_text()
    assert "\npagedserve:device_blocks_used{" in m
    used = [line for line in m.splitlines() if line.startswith("pagedserve:device_blocks_used{")]
    assert all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in used), used


def test_sigkill_of_one_of_three_executors_mid_run_loses_nothing(tmp_path: Path) -> None:
    # 20 ms steps: a loaded client still reads a third of the tokens while the executors run (at 5 ms
    # the whole run could end before the client had seen a third, and the victim ran nothing).
    slow = [*SIM[:2], "20", *SIM[3:]]
    with running_pool(tmp_path, 3, slow, ["--max-num-seqs", "64"]) as pool:
        reference = asyncio.run(generate_all(pool.address, NUM, MAX_TOKENS))
        assert all(reason == LENGTH and len(ids) == MAX_TOKENS for ids, reason in reference)
        victim = pool.executor_address(2)
        killed: list[dict[str, float]] = []

        async def maybe_kill(done: int) -> None:
            if not killed and done >= NUM * MAX_TOKENS // 3:
                killed.append(pool.per_executor("pagedserve:executor_num_requests_running"))
                pool.kill_executor(victim)

        disturbed = asyncio.run(generate_all(pool.address, NUM, MAX_TOKENS, maybe_kill))
        assert killed and killed[0][victim] > 0, f"the victim ran nothing when killed: {killed}"
        assert disturbed == reference
        assert f"off executor {victim}" in (tmp_path / "scheduler.log").read_text()
        assert pool.serving() == {pool.executor_address(1), pool.executor_address(3)}
        wait_until(lambda: serving(pool.address), 30, "health SERVING while any executor serves")
        assert_idle(pool)
        assert pool.scheduler is not None and pool.scheduler.poll() is None
        for n in (1, 3):
            pool.kill_executor(pool.executor_address(n))
        wait_until(lambda: not serving(pool.address), what="NOT_SERVING with no executor left")


def test_an_executor_joining_mid_run_takes_work_and_every_stream_is_exact(tmp_path: Path) -> None:
    with running_pool(tmp_path, 2, SIM, ["--max-num-seqs", "16"]) as pool:
        reference = asyncio.run(generate_all(pool.address, NUM, MAX_TOKENS))
        newcomer = pool.start_executor(3)
        joined: list[bool] = []

        async def maybe_join(done: int) -> None:
            if not joined and done >= NUM * MAX_TOKENS // 4:
                joined.append(True)
                pool.publish([pool.executor_address(1), pool.executor_address(2), newcomer])

        disturbed = asyncio.run(generate_all(pool.address, NUM, MAX_TOKENS, maybe_join))
        assert joined
        assert disturbed == reference
        assert steps(pool).get(newcomer, 0) > 0, "the new executor never ran a step"
        assert_idle(pool)


def test_the_dns_name_adds_and_drops_executors_and_drain_stops_new_work(tmp_path: Path) -> None:
    with running_pool(tmp_path, 1, SIM) as pool:
        one, two, three = (pool.executor_address(n) for n in (1, 2, 3))
        pool.start_executor(2)
        pool.start_executor(3, ["--num-gpu-blocks", "300"])  # executors may differ in pool size
        pool.publish([one, two])
        pool.wait_serving({one, two})
        pool.publish([two, three])
        pool.wait_serving({two, three})
        wait_until(lambda: one not in pool.per_executor("pagedserve:executor_num_device_blocks"),
                   what="the dropped executor's series removed")
        assert pool.per_executor("pagedserve:executor_num_device_blocks") == {two: 1024, three: 300}
        results = asyncio.run(generate_all(pool.address, 40, 8))
        assert all(reason == LENGTH and len(ids) == 8 for ids, reason in results)
        before = steps(pool)
        assert before[two] > 0 and before[three] > 0, before

        pool.drain([three])
        pool.wait_serving({two})
        results = asyncio.run(generate_all(pool.address, 40, 8))
        assert all(reason == LENGTH and len(ids) == 8 for ids, reason in results)
        after = steps(pool)
        assert after[three] == before[three], "a draining executor got new work"
        assert after[two] > before[two]
        pool.drain([])
        pool.wait_serving({two, three})


@pytest.mark.slow
def test_greedy_outputs_of_two_torch_executors_equal_one_executors(tmp_path: Path) -> None:
    torch_ex = ["--num-gpu-blocks", "256", "--num-cpu-blocks", "32", "--device", "cpu"]
    with running_pool(tmp_path, 2, torch_ex, ["--max-num-seqs", "4"]) as pool:
        two = asyncio.run(generate_all(pool.address, 8, 10))
        assert all(s > 0 for s in steps(pool).values()) and len(steps(pool)) == 2, steps(pool)
        pool.drain([pool.executor_address(2)])
        pool.wait_serving({pool.executor_address(1)})
        one = asyncio.run(generate_all(pool.address, 8, 10))
    assert all(reason == LENGTH and len(ids) == 10 for ids, reason in one)
    assert two == one


def test_the_conformance_suite_runs_against_each_executor_of_a_pool(tmp_path: Path) -> None:
    """PAGEDSERVE_EXECUTOR takes a list: the suite passes on each executor (here two of different sizes)."""
    pool = Pool(tmp_path, 0, ["--simulated"], tmp_path / "hosts", tmp_path / "drain")
    try:
        small = pool.start_executor(1, ["--num-gpu-blocks", "64", "--num-cpu-blocks", "64"])
        large = pool.start_executor(2, ["--num-gpu-blocks", "256", "--num-cpu-blocks", "64"])
        env = {**os.environ, "PAGEDSERVE_EXECUTOR": f"{small},{large}"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                            "tests/e2e/test_conformance.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=240)
    finally:
        for proc in pool.executors.values():
            stop(proc)
    assert r.returncode == 0, r.stdout[-3000:]
    passed = [line for line in r.stdout.splitlines() if " PASSED" in line]
    per_executor = {a: sum(f"external:{a}" in line for line in passed) for a in (small, large)}
    assert per_executor[small] >= 10 and per_executor[small] == per_executor[large], per_executor


def test_an_executor_of_another_model_is_refused_with_a_clear_log(tmp_path: Path) -> None:
    with running_pool(tmp_path, 1, SIM) as pool:
        other = pool.start_executor(2, ["--sim-vocab-size", "1000"])
        pool.publish([pool.executor_address(1), other])
        log = tmp_path / "scheduler.log"
        wait_until(lambda: f"executor {other} refused" in log.read_text(), what="the refusal logged")
        line = next(line for line in log.read_text().splitlines() if f"executor {other} refused" in line)
        assert "ERROR" in line and "vocab 1000" in line and "same model" in line
        assert pool.serving() == {pool.executor_address(1)}
        results = asyncio.run(generate_all(pool.address, 8, 4))
        assert all(len(ids) == 4 for ids, _ in results)
        assert other not in steps(pool)


def test_sighup_applies_the_drain_file_at_once(tmp_path: Path) -> None:
    with running_pool(tmp_path, 2, SIM, resolve_interval=600) as pool:
        one, two = pool.executor_address(1), pool.executor_address(2)
        pool.drain([two])
        assert pool.scheduler is not None
        pool.scheduler.send_signal(signal.SIGHUP)
        pool.wait_serving({one}, timeout=30)
        pool.drain([])
        pool.scheduler.send_signal(signal.SIGHUP)
        pool.wait_serving({one, two}, timeout=30)


def test_requests_run_only_where_max_model_len_holds_them(tmp_path: Path) -> None:
    """Executor 1 holds 64 tokens, executor 2 holds 512. A request for prompt + 100 tokens is validated
    against the pool's largest and runs whole on executor 2; short requests still use both."""
    with running_pool(tmp_path, 1, [*SIM, "--max-model-len", "64"], ["--api-server-count", "0"]) as pool:
        small = pool.executor_address(1)
        large = pool.start_executor(2, ["--max-model-len", "512"])
        pool.publish([small, large])
        pool.wait_serving({small, large})
        long_runs = asyncio.run(generate_all(pool.address, 8, 100))
        assert all(reason == LENGTH and len(ids) == 100 for ids, reason in long_runs)
        assert steps(pool).get(small, 0) == 0, "a long request ran on the 64-token executor"
        short_runs = asyncio.run(generate_all(pool.address, 40, 10))
        assert all(len(ids) == 10 for ids, _ in short_runs)
        assert steps(pool).get(small, 0) > 0, "requests that fit both never used the small executor"


def test_the_siblings_of_an_n_request_run_on_one_executor(tmp_path: Path) -> None:
    """n = 4 through the default process layout (the siblings cross the api server's IPC): all four land on
    the executor of the first, where they share its prompt's blocks; the other executor runs no step."""
    with running_pool(tmp_path, 2, SIM) as pool:
        async def siblings() -> list[generation_pb2.GenerateResponse]:
            async with PagedServeClient(pool.address) as client:
                return [r async for r in client.generate(prompt_token_ids=list(range(3, 67)), n=4, seed=5,
                                                         max_tokens=12, ignore_eos=True)]

        finals = [r for r in asyncio.run(siblings()) if r.finish_reason]
        assert sorted(r.index for r in finals) == [0, 1, 2, 3]
        assert all(r.finish_reason == LENGTH and r.usage.completion_tokens == 12 for r in finals)
        stepped = {a for a, n in steps(pool).items() if n > 0}
        assert len(stepped) == 1, f"siblings ran on {sorted(stepped)}"
