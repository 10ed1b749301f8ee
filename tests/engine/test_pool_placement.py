"""ExecutorPool in-process: placement rules, moves between block domains, model checks, address parsing and
resolution (injected and the real getaddrinfo)."""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.config import ExecutorTarget, parse_target
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.executor_loop import ExecutorLoop
from scheduler_service.engine.pool import ExecutorPool, Member, PoolConfig
from scheduler_service.messages import QueueFull
from scheduler_service.name_resolution import Resolver, pick_family

LIMITS = ExecutorLimits(block_size=16, num_device_blocks=256, num_swap_blocks=16, max_model_len=4096)


def member(core: CoreConfig, label: str, max_queue_len: int = 1000,
           max_model_len: int = LIMITS.max_model_len) -> ExecutorLoop:
    """An engine with a scheduler that counts as connected (described), with no executor behind it."""
    engine = ExecutorLoop(core, label, max_queue_len)
    engine.scheduler = Scheduler(core, replace(LIMITS, max_model_len=max_model_len))
    engine.describe = executor_pb2.DescribeResponse(model_id="m", vocab_size=100, max_model_len=max_model_len)
    engine.ready.set()
    return engine


def pool_of(n: int, max_num_seqs: int = 8, max_queue_len: int = 1000,
            max_model_lens: tuple[int, ...] = ()) -> ExecutorPool:
    core = CoreConfig(max_num_seqs=max_num_seqs)
    pool = ExecutorPool(PoolConfig([f"127.0.0.{i}:1" for i in range(1, n + 1)]), core, max_queue_len)
    lengths = max_model_lens or (LIMITS.max_model_len,) * n
    for i, length in enumerate(lengths, 1):
        engine = member(core, f"127.0.0.{i}:1", max_queue_len, length)
        pool.members[engine.label] = Member(engine)
        assert pool._admit(engine.describe) == ""  # type: ignore[arg-type]
        pool._member_ready(pool.members[engine.label], True)
    return pool


def request(rid: str, prompt_len: int = 8, max_tokens: int = 4, sibling_of: str | None = None) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingOptions(max_tokens=max_tokens), 0.0,
                   share_prompt_with=sibling_of)


def engines(pool: ExecutorPool) -> list[ExecutorLoop]:
    return [m.loop for m in pool.members.values()]


def queue() -> asyncio.Queue[RequestDelta]:
    return asyncio.Queue()


async def test_new_requests_spread_by_load() -> None:
    pool = pool_of(3)
    for i in range(30):
        pool.add(request(f"r{i}"), queue())
    assert [e.load()[1] for e in engines(pool)] == [10, 10, 10]


async def test_requests_arriving_one_at_a_time_take_equal_executors_in_turn() -> None:
    pool = pool_of(3)
    owners = []
    for i in range(6):
        stream = pool.add(request(f"r{i}"), queue())
        owner = pool._owner(stream.request.request_id)
        assert owner is not None
        owners.append(owner.label)
        pool.abort(f"r{i}")
        assert all(e.load()[:2] == (0, 0) for e in engines(pool))
    assert owners[:3] == owners[3:] and sorted(owners[:3]) == sorted(e.label for e in engines(pool))


async def test_cache_affinity_wins_while_balanced_and_load_wins_when_not() -> None:
    pool = pool_of(2)
    first, second = engines(pool)
    second.cached_prefix_tokens = lambda request: request.num_prompt_tokens  # type: ignore[method-assign]
    for i in range(9):
        pool.add(request(f"r{i}"), queue())
    # All go to the executor caching the prefix until the load gap (4 per waiting request) passes 32.
    assert first.load()[1] == 0 and second.load()[1] == 9
    pool.add(request("next"), queue())
    assert "next" in first.streams


async def test_a_small_cached_fraction_does_not_attract() -> None:
    pool = pool_of(2)
    first, second = engines(pool)
    second.cached_prefix_tokens = lambda request: 1  # type: ignore[method-assign]
    for i in range(10):
        pool.add(request(f"r{i}", prompt_len=100), queue())
    assert first.load()[1] == 5 and second.load()[1] == 5


async def test_requests_of_a_lost_executor_move_to_the_others_and_keep_their_streams() -> None:
    pool = pool_of(3)
    q = queue()
    streams = [pool.add(request(f"r{i}"), q) for i in range(9)]
    lost = engines(pool)[0]
    held = [s.request.request_id for s in streams if s.request.request_id in lost.streams]
    assert held
    lost.ready.clear()
    pool._member_ready(pool.members[lost.label], False)
    assert lost.idle() and not lost.streams
    for rid in held:
        owner = pool._owner(rid)
        assert owner is not None and owner is not lost
        assert owner.scheduler is not None and owner.scheduler.requests[rid].status is RequestStatus.WAITING


async def test_rebalance_moves_waiting_requests_to_an_executor_with_room() -> None:
    pool = pool_of(1, max_num_seqs=4)
    for i in range(12):
        pool.add(request(f"r{i}"), queue())
    newcomer = member(CoreConfig(max_num_seqs=4), "127.0.0.9:1")
    pool.members[newcomer.label] = Member(newcomer)
    pool.rebalance()
    assert newcomer.load()[1] == 4  # its max_num_seqs
    assert sum(e.load()[1] for e in engines(pool)) == 12


async def test_duplicate_ids_and_the_queue_limit_hold_across_the_pool() -> None:
    pool = pool_of(2, max_queue_len=3)
    pool.add(request("a"), queue())
    with pytest.raises(ValueError, match="duplicate"):
        pool.add(request("a"), queue())
    pool.add(request("b"), queue())
    pool.add(request("c"), queue())
    with pytest.raises(QueueFull):
        pool.add(request("d"), queue())


async def test_draining_members_get_no_new_work_and_hand_back_their_queue() -> None:
    pool = pool_of(2)
    first, second = engines(pool)
    for i in range(6):
        pool.add(request(f"r{i}"), queue())
    pool.members[second.label].draining = True
    pool._move_waiting(pool.members[second.label])
    assert second.idle() and first.load()[1] == 6
    pool.add(request("new"), queue())
    assert "new" in first.streams


async def test_the_siblings_of_an_n_request_follow_the_first_one() -> None:
    pool = pool_of(2)
    for i in range(4):  # one at a time, as the front-end adds them; load alone would alternate
        pool.add(request(f"x#{i}", prompt_len=64, sibling_of="x#0" if i else None), queue())
    assert [sorted(e.streams) for e in engines(pool)] == [["x#0", "x#1", "x#2", "x#3"], []]
    pool.add(request("y"), queue())
    assert "y" in engines(pool)[1].streams, "other requests still go by load"


async def test_rebalance_keeps_siblings_with_the_first_one() -> None:
    pool = pool_of(1, max_num_seqs=4)
    for i in range(8):
        pool.add(request(f"x#{i}", sibling_of="x#0" if i else None), queue())
    newcomer = member(CoreConfig(max_num_seqs=4), "127.0.0.9:1")
    pool.members[newcomer.label] = Member(newcomer)
    pool.rebalance()
    assert newcomer.idle(), f"siblings moved away from x#0: {sorted(newcomer.streams)}"


async def test_requests_go_only_where_max_model_len_holds_them_and_validation_uses_the_largest() -> None:
    pool = pool_of(2, max_model_lens=(64, 512))
    small, large = engines(pool)
    assert pool.describe is not None and pool.describe.max_model_len == 512
    for i in range(6):
        pool.add(request(f"long{i}", prompt_len=20, max_tokens=100), queue())
    assert not small.streams and len(large.streams) == 6
    pool.add(request("short", prompt_len=20, max_tokens=10), queue())
    assert "short" in small.streams, "a request that fits both still goes by load"
    large.ready.clear()
    pool._member_ready(pool.members[large.label], False)
    with pytest.raises(QueueFull, match="max_model_len"):
        pool.add(request("too long for the one serving", prompt_len=20, max_tokens=100), queue())
    assert all(rid.startswith("long") for rid in large.streams), "none fits the other executor: they wait"


async def test_rebalance_moves_only_what_fits_the_destination() -> None:
    pool = pool_of(1, max_num_seqs=4, max_model_lens=(512,))
    for i in range(12):
        pool.add(request(f"long{i}", prompt_len=20, max_tokens=100), queue())
    newcomer = member(CoreConfig(max_num_seqs=4), "127.0.0.9:1", max_model_len=64)
    pool.members[newcomer.label] = Member(newcomer)
    pool.rebalance()
    assert newcomer.idle()


async def test_the_pools_max_model_len_follows_its_members() -> None:
    pool = pool_of(2, max_model_lens=(64, 512))
    assert pool.describe is not None and pool.describe.max_model_len == 512
    await pool._close(pool.members[engines(pool)[1].label])
    assert pool.describe.max_model_len == 64


def describe(model_id: str, vocab: int = 100) -> executor_pb2.DescribeResponse:
    return executor_pb2.DescribeResponse(model_id=model_id, vocab_size=vocab)


def test_an_executor_serving_another_model_is_refused() -> None:
    pool = ExecutorPool(PoolConfig(["a:1"]), CoreConfig(), 10)
    assert pool._admit(describe("llama")) == ""
    assert pool._admit(describe("llama")) == ""
    refusal = pool._admit(describe("mistral"))
    assert "'mistral'" in refusal and "'llama'" in refusal and "same model" in refusal


@pytest.mark.parametrize(("text", "target"), [
    ("executor:50061", ExecutorTarget("executor", 50061)),
    ("dns:///executor.ns.svc:50061", ExecutorTarget("executor.ns.svc", 50061, dns=True)),
    ("[::1]:7", ExecutorTarget("::1", 7)),
])
def test_parse_target(text: str, target: ExecutorTarget) -> None:
    assert parse_target(text) == target
    assert str(parse_target(text)) == text


@pytest.mark.parametrize("text", ["executor", "dns:///x", "x:0", "x:99999", ":5", "dns:///:5"])
def test_parse_target_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_target(text)


async def test_resolver_follows_a_changing_answer_and_keeps_the_last_on_a_temporary_failure() -> None:
    answers: list[list[str] | Exception] = [["10.0.0.1", "10.0.0.2"], ["10.0.0.2", "10.0.0.3"],
                             socket.gaierror(socket.EAI_AGAIN, "try again"),
                             socket.gaierror(socket.EAI_NONAME, "no such name")]

    async def fake(host: str, port: int) -> list[tuple[int, int, int, str, tuple[str, int]]]:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]

    resolver = Resolver(getaddrinfo=fake)
    targets = [parse_target("dns:///executor:9"), parse_target("static:8")]
    assert await resolver.resolve(targets) == {"10.0.0.1:9", "10.0.0.2:9", "static:8"}
    assert await resolver.resolve(targets) == {"10.0.0.2:9", "10.0.0.3:9", "static:8"}
    assert await resolver.resolve(targets) == {"10.0.0.2:9", "10.0.0.3:9", "static:8"}
    assert await resolver.resolve(targets) == {"static:8"}


def test_a_dual_stack_answer_counts_each_executor_once() -> None:
    infos = [(socket.AF_INET6, 1, 6, "", ("fd00::1", 9, 0, 0)), (socket.AF_INET, 1, 6, "", ("10.0.0.1", 9))]
    assert pick_family(infos) == ["10.0.0.1"]
    assert pick_family(infos[:1]) == ["fd00::1"]


async def test_the_real_resolver_resolves_localhost() -> None:
    found = await Resolver().resolve([parse_target("dns:///localhost:50061")])
    assert found & {"127.0.0.1:50061", "[::1]:50061"}
    assert len(found) == 1


async def test_the_hosts_file_overrides_dns_and_is_reread(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 pool.test  # comment\n127.0.0.3 pool.test other\n")
    resolver = Resolver(str(hosts))
    target = [parse_target("dns:///pool.test:7")]
    assert await resolver.resolve(target) == {"127.0.0.2:7", "127.0.0.3:7"}
    hosts.write_text("127.0.0.4 POOL.TEST\n")
    assert await resolver.resolve(target) == {"127.0.0.4:7"}


async def test_moved_requests_go_ahead_of_the_new_executors_queue_in_their_order() -> None:
    pool = pool_of(2)
    for i in range(6):
        pool.add(request(f"r{i}"), queue())
    lost, other = engines(pool)
    assert sorted(lost.streams) == ["r0", "r2", "r4"]
    lost.ready.clear()
    pool._member_ready(pool.members[lost.label], False)
    assert other.scheduler is not None
    admitted = [w.request.request_id for w in other.scheduler.schedule().scheduled]
    assert admitted == ["r0", "r2", "r4", "r1", "r3", "r5"]


class OfflineLoop(ExecutorLoop):
    """An ExecutorLoop with no executor behind it: start() describes it at once (through the pool's admit
    check) and it counts as connected; stop() is recorded."""

    stopped = False

    async def start(self) -> None:
        self.scheduler = Scheduler(self.core_config, LIMITS)
        self.describe = executor_pb2.DescribeResponse(model_id="m", vocab_size=100, max_model_len=LIMITS.max_model_len)
        assert self.admit is not None and self.admit(self.describe) == ""
        self.ready.set()
        if self.on_ready_change is not None:
            self.on_ready_change(True)

    async def stop(self) -> None:
        self.stopped = True
        await super().stop()


async def test_an_executor_that_leaves_the_dns_answer_is_drained_then_removed_from_the_pool() -> None:
    answer = ["10.0.0.1", "10.0.0.2"]

    async def fake(host: str, port: int) -> list[tuple[int, int, int, str, tuple[str, int]]]:
        assert (host, port) == ("executors", 9)
        if not answer:
            raise socket.gaierror(socket.EAI_NONAME, "no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]

    core = CoreConfig(max_num_seqs=8)
    made: dict[str, OfflineLoop] = {}

    def make_loop(address: str, metrics: object) -> ExecutorLoop:
        made[address] = OfflineLoop(core, address, 1000)
        return made[address]

    pool = ExecutorPool(PoolConfig(["dns:///executors:9"]), core, 1000, make_loop=make_loop,
                        resolver=Resolver(getaddrinfo=fake))

    async def refresh() -> None:
        await pool.refresh()
        await asyncio.gather(*(m.task for m in pool.members.values() if m.task is not None))

    await refresh()
    assert set(pool.members) == {"10.0.0.1:9", "10.0.0.2:9"} and pool.ready.is_set()
    for i in range(4):
        pool.add(request(f"r{i}"), queue())
    # The members joined in set order: name them by the requests placed on them.
    first, second = sorted(made.values(), key=lambda loop: "r0" not in loop.streams)
    assert sorted(first.streams) == ["r0", "r2"] and sorted(second.streams) == ["r1", "r3"]
    assert first.scheduler is not None
    first.scheduler.schedule()  # r0 and r2 run on the first executor
    # The first executor leaves the answer: it takes no new work, and stays until its requests end.
    answer[:] = [second.label.removesuffix(":9")]
    await refresh()
    assert pool.members[first.label].leaving and not pool.members[first.label].serving
    assert pool.serving() == [second] and not first.stopped
    pool.add(request("r4"), queue())
    assert sorted(second.streams) == ["r1", "r3", "r4"]
    pool.abort("r0")
    pool.finish("r2", FinishReason.STOPPED)
    assert first.idle()
    await refresh()
    assert list(pool.members) == [second.label] and first.stopped and not second.stopped
    assert pool.ready.is_set() and sorted(second.streams) == ["r1", "r3", "r4"]
    # A leaving executor's waiting requests move at once to a serving one, and the executor goes with them.
    answer[:] = [second.label.removesuffix(":9"), "10.0.0.3"]
    await refresh()
    third = made["10.0.0.3:9"]
    assert set(pool.members) == {second.label, third.label} and not third.streams
    answer[:] = ["10.0.0.3"]
    await refresh()
    assert set(pool.members) == {"10.0.0.3:9"} and second.stopped
    assert sorted(third.streams) == ["r1", "r3", "r4"] and not second.streams
    # No address at all: the pool stops serving; the last executor keeps its waiting requests (there is
    # nowhere to move them) and goes once they end.
    answer.clear()
    await refresh()
    assert list(pool.members) == ["10.0.0.3:9"] and pool.members["10.0.0.3:9"].leaving
    assert not pool.ready.is_set() and not third.stopped and sorted(third.streams) == ["r1", "r3", "r4"]
    for rid in ("r1", "r3", "r4"):
        pool.abort(rid)
    await refresh()
    assert pool.members == {} and third.stopped and not pool.ready.is_set()
    await pool.stop()


async def forever() -> None:
    await asyncio.Event().wait()


def lose(pool: ExecutorPool, engine: ExecutorLoop, reconnecting: asyncio.Task[None] | None = None) -> None:
    """The member's executor is lost; with `reconnecting` (a running task standing in for its loop) it is
    connecting again, as ExecutorLoop._recover leaves it."""
    engine.ready.clear()
    if reconnecting is not None:
        engine._lost_since = time.monotonic()
        engine._task = reconnecting
    pool._member_ready(pool.members[engine.label], False)


async def test_with_no_executor_serving_a_new_request_waits_on_a_reconnecting_member() -> None:
    pool = pool_of(3)
    first, second, third = engines(pool)
    reconnecting = asyncio.create_task(forever())
    try:
        lose(pool, first)  # lost, its loop not running: it takes nothing
        lose(pool, second, reconnecting)
        lose(pool, third, reconnecting)
        pool.members[third.label].draining = True
        assert not pool.serving()
        pool.add(request("parked"), queue())  # not refused: it waits where the executor is coming back
        assert list(second.streams) == ["parked"] and not first.streams and not third.streams
        assert second.scheduler is not None and second.scheduler.requests["parked"].status is RequestStatus.WAITING
        first.ready.set()  # another executor serves first: the parked request goes there
        pool._member_ready(pool.members[first.label], True)
        assert list(first.streams) == ["parked"] and not second.streams
    finally:
        reconnecting.cancel()


async def test_a_request_parked_with_no_executor_serving_ends_unavailable_after_the_wait_timeout() -> None:
    pool = pool_of(1)
    [engine] = engines(pool)
    reconnecting = asyncio.create_task(forever())
    try:
        lose(pool, engine, reconnecting)
        q = queue()
        pool.add(request("parked"), q)
        engine.executor_wait_timeout = 0.0
        engine._fail_if_lost_too_long()
        delta = q.get_nowait()
        assert delta.finish_reason is FinishReason.ERROR and delta.error.startswith("no executor for ")
        assert not engine.streams
    finally:
        reconnecting.cancel()


async def test_with_no_member_reconnecting_a_new_request_is_refused_at_once() -> None:
    pool = pool_of(2)
    for engine in engines(pool):
        lose(pool, engine)  # e.g. its engine loop died: nothing would ever serve or expire the request
    with pytest.raises(QueueFull, match="no executor is serving"):
        pool.add(request("r"), queue())
