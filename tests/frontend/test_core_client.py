"""The api server's side of the engine-core socket: delivery, refusals and the per-stream buffer cap."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
import pytest
import zmq
import zmq.asyncio

from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.frontend.core_client import CoreClient, RemoteStream
from scheduler_service.frontend.core_set import AFFINITY_SLACK, AFFINITY_TOKENS, CoreSet
from scheduler_service.frontend.generation import RequestError
from scheduler_service.messages import (
    Delta,
    Ended,
    Refusal,
    Refused,
    Status,
    ToFrontend,
    encoder,
    ipc_address,
    to_core_decoder,
    to_frontend_decoder,
)


@pytest.fixture
async def client() -> AsyncIterator[Callable[[int], CoreClient]]:
    """Makes CoreClients that are never started, and closes them however the test ends: an unclosed one
    leaves a ZeroMQ context whose collection can hang the run after its last test (tests/support/watchdog.py)."""
    made: list[CoreClient] = []

    def make(max_buffered: int = 3) -> CoreClient:
        made.append(CoreClient("ipc:///nonexistent", b"test", max_buffered))
        return made[-1]

    yield make
    for c in made:
        await c.close()


def wire(msg: ToFrontend) -> ToFrontend:
    return to_frontend_decoder.decode(encoder.encode(msg))


async def test_a_stream_past_its_buffer_cap_is_aborted_in_the_core_after_what_it_holds(
        client: Callable[[int], CoreClient]) -> None:
    c = client(3)
    queue: asyncio.Queue[object] = asyncio.Queue()
    c.streams["r"] = RemoteStream(queue)
    for step in range(6):
        c._deliver(wire(ToFrontend([Delta("r", [step])])))
    items = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [d.new_token_ids for d in items[:3]] == [[0], [1], [2]]  # type: ignore[attr-defined]
    last = items[3]
    assert last.finish_reason is FinishReason.ABORTED and "--max-stream-buffer" in last.error  # type: ignore[attr-defined]
    assert len(items) == 4, "nothing more is buffered for it"
    assert c._ended == [Ended("r", FinishReason.ABORTED)] and "r" not in c.streams
    assert c.num_overflowed == 1 and c._unreported_overflows == 1


async def test_a_refusal_reaches_the_call_as_its_status_code(client: Callable[[int], CoreClient]) -> None:
    c = client(3)
    queue: asyncio.Queue[object] = asyncio.Queue()
    c.streams["r"] = RemoteStream(queue)
    c._refuse(wire(ToFrontend(refused=[Refused("r", Refusal.QUEUE_FULL, "full")])).refused)
    error = queue.get_nowait()
    assert isinstance(error, RequestError) and error.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "r" not in c.streams


async def test_adds_and_ends_of_one_loop_turn_go_to_the_core_as_one_message() -> None:
    address = ipc_address("test")
    ctx = zmq.asyncio.Context()
    core = ctx.socket(zmq.ROUTER)
    core.bind(address)
    c = CoreClient(address, b"api-0-0", 8)
    try:
        await c.start()
        identity, hello = await asyncio.wait_for(core.recv_multipart(), 10)
        assert identity == b"api-0-0" and to_core_decoder.decode(hello).hello
        options = SamplingOptions(max_tokens=4)
        for i in range(5):
            c.add(Request(f"r{i}", [1, 2], options, 0.0), asyncio.Queue())
        c.abort("r0")
        c.finish("r1", FinishReason.STOPPED)
        _, payload = await asyncio.wait_for(core.recv_multipart(), 10)
        msg = to_core_decoder.decode(payload)
        assert [n.request_id for n in msg.new] == [f"r{i}" for i in range(5)]
        assert msg.ended == [Ended("r0", FinishReason.ABORTED), Ended("r1", FinishReason.STOPPED)]
        assert await core.poll(50) == 0, "one message for the whole turn"
    finally:
        await c.close()
        core.close(linger=0)
        ctx.term()


async def test_a_lost_core_s_open_requests_are_re_submitted_as_continuations_once_a_core_is_ready(
        client: Callable[[int], CoreClient]) -> None:
    c = client(100)
    queue: asyncio.Queue[object] = asyncio.Queue()
    c.add(Request("r", [1, 2, 3], SamplingOptions(max_tokens=9, seed=4), 12.5), queue)
    c._flush()
    c._deliver(wire(ToFrontend([Delta("r", [7, 8])])))
    c._lost("test")
    assert not c.ready.is_set() and c._new == []
    c._session.number += 1  # what the session does before its next hello
    c._set_status(Status(False))
    assert c._new == [], "nothing goes to a core that is not ready"
    c._set_status(Status(True))
    [again] = c._new
    assert (again.request_id, again.prompt_token_ids, again.output_token_ids, again.resume) == (
        "r", [1, 2, 3], [7, 8], True)
    assert again.sampling.seed == 4 and again.arrival_time == 12.5 and c.num_resumed == 1
    assert c.ready.is_set() and c.lost_since is None


async def test_a_core_set_moves_a_lost_core_s_requests_to_a_ready_survivor(
        client: Callable[[int], CoreClient]) -> None:
    a, b = client(100), client(100)
    cores = CoreSet([a, b])
    for core in (a, b):
        core._set_status(Status(True))
    queue: asyncio.Queue[object] = asyncio.Queue()
    for i in range(4):
        cores.add(Request(f"r{i}", [1, 2], SamplingOptions(max_tokens=9), 0.0), queue)
    assert len(a.streams) == len(b.streams) == 2, "placed on the least loaded core"
    lost_ids = set(a.streams)
    a._deliver(wire(ToFrontend([Delta(rid, [5]) for rid in lost_ids])))
    b._new.clear()
    a._lost("test")
    assert not a.streams and set(b.streams) == {f"r{i}" for i in range(4)} and cores.num_moved == 2
    assert {n.request_id: n.output_token_ids for n in b._new} == {rid: [5] for rid in lost_ids}
    assert cores.ready.is_set(), "still ready: one core serves"
    cores.abort("r0")
    assert "r0" not in b.streams and "r0" not in cores.owner


async def test_requests_sharing_a_prefix_go_to_one_core_the_same_from_every_front_end() -> None:
    """Placement by cached prefix: prompts sharing their first AFFINITY_TOKENS tokens go to one core (the same one
    from a second front-end's CoreSet), while that core is within AFFINITY_SLACK of the least loaded; short prompts
    and a core past the slack go by load."""
    made = [CoreClient(f"ipc:///nonexistent-{i}", b"test", 100) for i in range(4)]
    first, second = CoreSet(made[:2]), CoreSet(made[2:])
    try:
        for core in made:
            core._set_status(Status(True))
        queue: asyncio.Queue[object] = asyncio.Queue()
        system = list(range(100, 100 + AFFINITY_TOKENS))
        for i in range(AFFINITY_SLACK + 1):  # the last one while the prefix's core is AFFINITY_SLACK ahead
            first.add(Request(f"p{i}", [*system, i], SamplingOptions(max_tokens=9), 0.0), queue)
        home = first.owner["p0"]
        assert all(first.owner[f"p{i}"] is home for i in range(AFFINITY_SLACK + 1)), "one core for the prefix"
        other = next(c for c in first.clients if c is not home)
        first.add(Request("past", [*system, 99], SamplingOptions(max_tokens=9), 0.0), queue)
        assert first.owner["past"] is other, "past the slack, by load"
        first.add(Request("short", [1, 2, 3], SamplingOptions(max_tokens=9), 0.0), queue)
        assert first.owner["short"] is other, "a short prompt goes by load"
        made[2].address, made[3].address = made[0].address, made[1].address  # the same cores, seen from elsewhere
        second.add(Request("q", [*system, 7], SamplingOptions(max_tokens=9), 0.0), queue)
        assert second.owner["q"].address == home.address, "every front-end picks the same core for a prefix"
    finally:
        await first.close()
        await second.close()


async def test_a_retired_core_gets_no_new_request_and_hands_its_requests_to_a_core_that_becomes_ready() -> None:
    """dns:/// membership (#28): the old address of a restarted core is retired; its requests, lost with it while
    no other core was ready, move to the new address's core as soon as that one is ready."""
    old, new = CoreClient("ipc:///nonexistent-old", b"test", 100), CoreClient("ipc:///nonexistent-new", b"test", 100)
    cores = CoreSet([old, new])
    try:
        old._set_status(Status(True))
        queue: asyncio.Queue[object] = asyncio.Queue()
        cores.add(Request("r0", [1, 2], SamplingOptions(max_tokens=9), 0.0), queue)
        old._deliver(wire(ToFrontend([Delta("r0", [5])])))
        old._lost("test")
        assert set(old.streams) == {"r0"}, "no ready core to move to: the request waits"
        cores.retire(old.address)
        assert cores.addresses() == {new.address}
        cores.add(Request("r1", [3], SamplingOptions(max_tokens=9), 0.0), queue)
        assert "r1" in new.streams, "a retired core gets no new request"
        new._set_status(Status(True))
        assert not old.streams and {"r0", "r1"} <= set(new.streams) and cores.owner["r0"] is new
        assert [n.output_token_ids for n in new._new if n.request_id == "r0"] == [[5]]
        await cores.sweep()
        assert cores.clients == [new] and not cores.retired
    finally:
        await cores.close()  # the sweep closed the retired one


async def test_a_message_that_fails_ends_the_session_as_a_lost_core_instead_of_its_reading(
        client: Callable[[int], CoreClient], monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler that raises (or a payload that does not decode) used to end the session's read loop silently:
    every open stream hung. Now the session reports itself lost, so its open requests are resumed."""
    session = client(3)._session

    def broken(msg: ToFrontend) -> None:
        raise RuntimeError("a bug in handling")

    monkeypatch.setattr(session, "_on_message", broken)
    assert "failed" in session._receive(encoder.encode(ToFrontend([Delta("r", [1])])))
    assert "failed" in session._receive(b"\xc1 not msgpack")
