"""The process layout: an engine core process with --api-server-count front-end processes on one port."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from client.lib import build_request
from protos.pagedserve.v1 import generation_pb2, generation_pb2_grpc
from protos.wire import GRPC_OPTIONS
from scheduler_service.frontend.generation import API_SERVER_HEADER
from tests.support.procs import (
    ROOT,
    Stack,
    process_gone,
    running_http_stack,
    running_stack,
    wait_healthy,
    wait_until,
)

LENGTH = generation_pb2.FINISH_REASON_LENGTH
EXECUTOR = ["--simulated", "--sim-step-latency-ms", "5"]


def api_server_pids(stack: Stack) -> set[int]:
    """The scheduler's children started by multiprocessing spawn (not its resource tracker)."""
    out: set[int] = set()
    for task in Path(f"/proc/{stack.scheduler.pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                out.add(int(child))
    return out


def listeners(port: int) -> int:
    """Sockets listening on the port (one per api server, through SO_REUSEPORT), from /proc/net/tcp."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            count += state == "0A" and int(local.rsplit(":", 1)[1], 16) == port
    return count


class Stream:
    """One Generate call on its own connection (a fresh channel, so the kernel may pick either process)."""

    def __init__(self, address: str, **kwargs: object) -> None:
        options = [*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        self.channel = grpc.aio.insecure_channel(address, options=options)
        stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.call = stub.Generate(build_request(**kwargs), timeout=60)  # type: ignore[arg-type]
        self.server = (-1, -1)

    async def open(self) -> tuple[int, int]:
        md = dict(await self.call.initial_metadata())
        index, pid = md[API_SERVER_HEADER].split()
        self.server = (int(index), int(pid))
        return self.server

    async def collect(self) -> tuple[list[int], int]:
        ids: list[int] = []
        reason = 0
        async for r in self.call:
            ids += r.token_ids
            reason = r.finish_reason or reason
        return ids, reason

    async def close(self) -> None:
        await self.channel.close()


async def streams_on_both(address: str, **kwargs: object) -> dict[int, Stream]:
    """Open calls on fresh connections until each of the two api servers serves one (others cancelled)."""
    port = int(address.rsplit(":", 1)[1])
    await asyncio.to_thread(wait_until, lambda: listeners(port) == 2, 30.0, "two api servers listening")
    found: dict[int, Stream] = {}
    for _ in range(64):
        stream = Stream(address, **kwargs)
        index, _ = await stream.open()
        if index in found:
            stream.call.cancel()
            await stream.close()
            continue
        found[index] = stream
        if len(found) == 2:
            return found
    raise AssertionError(f"64 connections all went to api server(s) {sorted(found)}")


def test_two_api_servers_both_serve_streams_with_exact_tokens(tmp_path: Path) -> None:
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2"]) as s:
        async def main() -> tuple[dict[int, tuple[list[int], int]], tuple[list[int], int]]:
            kwargs = {"prompt": "same prompt", "max_tokens": 40, "temperature": 0.7, "seed": 11}
            reference = Stream(s.address, **kwargs)
            await reference.open()
            expected = await reference.collect()
            await reference.close()
            both = await streams_on_both(s.address, **kwargs)
            results = {i: await st.collect() for i, st in both.items()}
            pids = {st.server[1] for st in both.values()}
            for st in both.values():
                await st.close()
            assert pids == api_server_pids(s), "each call names the pid of an api server of this scheduler"
            return results, expected

        results, expected = asyncio.run(main())
        assert sorted(results) == [0, 1]
        assert len(expected[0]) == 40 and expected[1] == LENGTH
        assert all(r == expected for r in results.values())


def test_a_dead_api_server_is_restarted_its_requests_aborted_and_the_other_keeps_serving(tmp_path: Path) -> None:
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2"]) as s:
        async def main() -> None:
            long = {"prompt": "x", "max_tokens": 3000, "ignore_eos": True}
            both = await streams_on_both(s.address, **long)
            victim, survivor = both[0], both[1]
            survivor_task = asyncio.create_task(survivor.collect())
            wait_until(lambda: s.metrics()["vllm:num_requests_running"] == 2, what="both streams running")
            os.kill(victim.server[1], signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await victim.collect()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            await asyncio.to_thread(wait_until, lambda: s.metrics()["vllm:num_requests_running"] == 1, 10.0,
                                    "the dead server's request aborted in the core")
            assert not survivor_task.done(), "the other api server's stream goes on"
            await asyncio.to_thread(wait_until, lambda: len(api_server_pids(s)) == 2 and
                                    victim.server[1] not in api_server_pids(s), 30.0, "a new api server")
            fresh = await streams_on_both(s.address, prompt="y", max_tokens=5)
            for st in fresh.values():
                assert (await st.collect())[1] == LENGTH
                await st.close()
            survivor.call.cancel()
            for st in both.values():
                await st.close()
            assert s.scheduler.poll() is None

        asyncio.run(main())
        assert "api server 0" in (tmp_path / "scheduler.log").read_text()


def test_the_engine_core_dying_takes_the_api_servers_down(tmp_path: Path) -> None:
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2"]) as s:
        pids = api_server_pids(s)
        assert len(pids) == 2
        s.scheduler.send_signal(signal.SIGKILL)
        s.scheduler.wait(timeout=10)
        # ~2.5 s; a loaded box took over 10
        wait_until(lambda: all(map(process_gone, pids)), timeout=30.0, what="the api servers to exit")
        assert "is gone; this api server exits" in (tmp_path / "scheduler.log").read_text()
        with pytest.raises(TimeoutError):
            wait_healthy(s.address, s.executor, timeout=1.0)


def test_sigterm_drains_the_streams_of_every_api_server(tmp_path: Path) -> None:
    with running_stack(tmp_path, EXECUTOR, ["--api-server-count", "2"]) as s:
        async def main() -> list[tuple[list[int], int]]:
            both = await streams_on_both(s.address, prompt="x", max_tokens=80, ignore_eos=True)
            tasks = [asyncio.create_task(st.collect()) for st in both.values()]
            await asyncio.to_thread(wait_until, lambda: s.metrics()["vllm:num_requests_running"] == 2, 10.0,
                                    "both streams running")
            s.scheduler.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*tasks)
            for st in both.values():
                await st.close()
            return results

        results = asyncio.run(main())
        assert results == [(results[0][0], LENGTH), (results[1][0], LENGTH)]
        assert [len(ids) for ids, _ in results] == [80, 80]
        assert s.scheduler.wait(timeout=30) == 0


def test_the_http_api_listens_in_every_api_server(tmp_path: Path) -> None:
    with running_http_stack(tmp_path, EXECUTOR, ["--api-server-count", "2"]) as s:
        http_port = s.ports["http_listen"]
        wait_until(lambda: listeners(http_port) == 2, 30.0, "both api servers listening for HTTP")
        body = json.dumps({"model": "simulated", "prompt": [65, 66], "max_tokens": 7, "seed": 3,
                           "temperature": 0.5}).encode()
        answers = []
        for _ in range(6):  # a fresh connection each: the kernel spreads them over both processes
            request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as r:
                answers.append(json.loads(r.read())["choices"][0])
        assert all(a["finish_reason"] == "length" for a in answers)
        assert len({a["text"] for a in answers}) == 1, "seeded: the same text from either process"


# A stand-in engine core: the real ApiServers starts one api server, prints its pid, and waits to be killed.
STAND_IN_CORE = """
import asyncio, sys
from scheduler_service.config import parse_config
from scheduler_service.engine.api_servers import ApiServers

async def main() -> None:
    config = parse_config(["--engine-core-secret-file", sys.argv[1], "--api-server-count", "1"])
    servers = ApiServers(config, sys.argv[2], "127.0.0.1:0", lambda identity: 0)
    servers.start()
    print(servers.servers[0].process.pid, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def open_for_writing(fifo: Path) -> int | None:
    """A descriptor writing to the FIFO once a reader has it open; None while none has."""
    try:
        return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return None
        raise


def feed(fifo: Path, text: str, what: str) -> None:
    """Write text to the next reader of the FIFO, once it has opened it."""
    opened: list[int] = []

    def reader_came() -> bool:
        fd = open_for_writing(fifo)
        opened.extend([] if fd is None else [fd])
        return fd is not None

    wait_until(reader_came, 60.0, what)
    with os.fdopen(opened[0], "w") as f:
        f.write(text)


def test_an_api_server_whose_core_died_while_it_started_exits(tmp_path: Path) -> None:
    # Deterministic by construction: the api server's start-up blocks on reading the link secret from a FIFO,
    # and the test writes it only after the core is dead and reaped; so the api server is already reparented
    # when its watcher starts, the case where os.getppid() read then named the new parent and it never exited.
    fifo, log_path = tmp_path / "secret", tmp_path / "core.log"
    os.mkfifo(fifo)
    with open(log_path, "wb") as log:
        core = subprocess.Popen([sys.executable, "-c", STAND_IN_CORE, str(fifo), f"ipc://{tmp_path}/no-core"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=log)
    api_pid = 0
    try:
        feed(fifo, "link secret\n", "the core to read the secret")
        assert core.stdout is not None
        api_pid = int(core.stdout.readline())
        wait_until(lambda: b"[api-server 0]" in log_path.read_bytes(), 60.0, "the api server to start")
        core.kill()
        core.wait(timeout=30)
        feed(fifo, "link secret\n", "the api server to read the secret")
        wait_until(lambda: process_gone(api_pid), 60.0, "the api server to exit")
        assert f"engine core (pid {core.pid}) is gone; this api server exits" in log_path.read_text()
    finally:
        core.kill()
        if api_pid and not process_gone(api_pid):
            os.kill(api_pid, signal.SIGKILL)
