"""Engine core restarts under streaming load, with front-ends on their own (#28): a SIGKILLed core's open requests
resume on the restarted core as continuations, and every stream ends with the tokens of an undisturbed run."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest

from client.local import loopback, start_listening, wait_healthy
from tests.support.procs import wait_until
from tests.support.streams import EXECUTOR, MAX_TOKENS, TokenCount, check_complete, run_all, specs
from tests.support.tiers import running_tiers


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_core_restart_mid_stream_resumes_every_stream_identically(tmp_path: Path, sig: int) -> None:
    calls = specs(24)
    total = sum(s.n for s in calls) * MAX_TOKENS
    secret = tmp_path / "link.secret"
    secret.write_text("a shared secret\n")
    link = ["--engine-core-secret-file", str(secret)]  # CURVE on the link, through the restart too
    with running_tiers(tmp_path, EXECUTOR, core_args=link, frontend_args=["--engine-core-timeout", "3", *link]
                       ) as tiers:
        reference = await run_all(tiers.public, calls)
        check_complete(reference, calls)
        tiers.wait_idle()
        count = TokenCount(total)
        disturbed = asyncio.create_task(run_all(tiers.public, calls, count))
        await asyncio.wait_for(count.quarter.wait(), 60)
        tiers.kill_core(sig)
        assert count.seen < total // 2, "the kill came while most tokens were still to come"
        tiers.start_core()
        outcome = await asyncio.wait_for(disturbed, 120)
        check_complete(outcome, calls)
        assert outcome == reference, "every stream: the tokens of the undisturbed run, none twice, none missing"
        tiers.wait_idle()
        assert "resumed" in (tmp_path / "frontend-2.log").read_text()


async def test_a_frontend_that_goes_silent_is_dropped_and_its_requests_freed(tmp_path: Path) -> None:
    calls = specs(6)
    with running_tiers(tmp_path, EXECUTOR, core_args=["--engine-core-timeout", "2"]) as tiers:
        frontend = tiers.frontends[0]
        streams = asyncio.create_task(run_all(tiers.public, calls, max_tokens=200))
        await asyncio.to_thread(wait_until, lambda: tiers.metrics().get("vllm:num_requests_running", 0) > 0, 30.0,
                                "requests running")
        frontend.send_signal(signal.SIGSTOP)  # alive but silent: only the heartbeat deadline can tell
        try:
            await asyncio.to_thread(tiers.wait_idle, 30.0)
            assert "silent for" in (tmp_path / "core-1.log").read_text()
        finally:
            frontend.send_signal(signal.SIGCONT)
        outcome = await asyncio.wait_for(streams, 120)  # it comes back, is told it is unknown, and resumes
        check_complete(outcome, calls, 200)
        assert outcome == await run_all(tiers.public, calls, max_tokens=200)


async def test_requests_of_a_core_that_does_not_come_back_end_unavailable_after_the_wait(tmp_path: Path) -> None:
    calls = specs(3)
    args = ["--engine-core-timeout", "1", "--engine-core-wait-timeout", "2"]
    with running_tiers(tmp_path, EXECUTOR, frontend_args=args) as tiers:
        streams = asyncio.create_task(run_all(tiers.public, calls, max_tokens=400))
        await asyncio.to_thread(wait_until, lambda: tiers.metrics().get("vllm:num_requests_running", 0) > 0, 30.0,
                                "requests running")
        tiers.kill_core(signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(streams, 30)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "--engine-core-wait-timeout" in str(e.value.details())


async def test_a_frontend_follows_a_dns_named_core_to_its_new_address(tmp_path: Path) -> None:
    """--engine-core dns:///NAME:PORT: the core is SIGKILLed and comes back at another address (as a container
    restarted with a new IP); the front-end re-resolves the name, joins the new core, and every stream resumes
    there with the tokens of an undisturbed run."""
    calls = specs(8)
    total = sum(s.n for s in calls) * MAX_TOKENS
    secret, hosts = tmp_path / "link.secret", tmp_path / "hosts"
    secret.write_text("a shared secret\n")
    hosts.write_text("127.0.0.1 engine-core\n")
    link = ["--engine-core-secret-file", str(secret)]
    with running_tiers(tmp_path, EXECUTOR, core_args=link, frontends=0) as tiers:
        port = tiers.core_address.rsplit(":", 1)[1]
        frontend, ports = start_listening("scheduler_service.frontend", [
            "--engine-core", f"dns:///engine-core:{port}", "--executor-hosts-file", str(hosts),
            "--executor-resolve-interval", "0.2", "--engine-core-timeout", "2", *link], tmp_path / "frontend-dns.log")
        tiers.frontends.append(frontend)
        tiers.public = loopback(ports["listen"])
        await asyncio.to_thread(wait_healthy, tiers.public, frontend)
        reference = await run_all(tiers.public, calls)
        check_complete(reference, calls)
        count = TokenCount(total)
        disturbed = asyncio.create_task(run_all(tiers.public, calls, count))
        await asyncio.wait_for(count.quarter.wait(), 60)
        tiers.kill_core(signal.SIGKILL)
        assert count.seen < total // 2, "the kill came while most tokens were still to come"
        tiers.core_address = f"tcp://127.0.0.2:{port}"
        tiers.start_core()
        hosts.write_text("127.0.0.2 engine-core\n")
        outcome = await asyncio.wait_for(disturbed, 120)
        check_complete(outcome, calls)
        assert outcome == reference, "every stream: the tokens of the undisturbed run, none twice, none missing"
        await asyncio.to_thread(tiers.wait_idle)
        log = (tmp_path / "frontend-dns.log").read_text()
        assert f"tcp://127.0.0.1:{port} is no longer among" in log and f"tcp://127.0.0.2:{port} joined" in log
