"""Data parallel: one ExecutorLoop (step loop + Scheduler, one block domain) per executor, behind one surface.

Placement of a new request (SGLang's cache-aware router's order, vLLM's DP load score):
  1. load balance wins while the pool is imbalanced: max - min load > BALANCE_ABS and max > BALANCE_REL * min;
  2. else the executor caching the longest prefix of the prompt, when it caches >= CACHE_THRESHOLD of it;
  3. else the least loaded, load = 4 * waiting + running (vLLM's DP score), ties to the lower KV usage, then
     in turn (requests that arrive one at a time, each after the last finished, still reach every executor).
Load wins over cache affinity because a hot prefix would otherwise pile every request onto one executor
while the others idle: a cache hit saves a prefill, a queue costs every step of every request behind it.
Before any of that: a request goes only to an executor whose max_model_len holds its prompt + max_tokens
(requests are validated against the pool's largest), and the siblings of an n > 1 request follow the first
one, so they share its prompt's blocks. Moves keep both rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.config import ExecutorTarget, parse_target
from scheduler_service.core.config import CoreConfig
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.engine.executor_loop import ExecutorLoop, RequestStream
from scheduler_service.engine.metrics import EngineMetrics
from scheduler_service.messages import QueueFull
from scheduler_service.name_resolution import Resolver

log = logging.getLogger("pagedserve.pool")
BALANCE_ABS, BALANCE_REL, CACHE_THRESHOLD = 32, 1.5, 0.3
REBALANCE_INTERVAL_S = 0.1
# (executor address, the pool's metrics once known) -> an ExecutorLoop for it: the service's flags live there.
LoopFactory = Callable[[str, EngineMetrics | None], ExecutorLoop]


@dataclass(slots=True)
class PoolConfig:
    executors: list[str]
    resolve_interval: float = 5.0
    hosts_file: str | None = None
    drain_file: str | None = None


@dataclass(slots=True)
class Member:
    loop: ExecutorLoop
    task: asyncio.Task[None] | None = None
    draining: bool = False   # in the drain file: no new work, waiting requests move, running ones finish
    leaving: bool = False    # gone from --executor / DNS: drained, then closed

    @property
    def serving(self) -> bool:
        return self.loop.ready.is_set() and not (self.draining or self.leaving)


def movable(request: Request, src: ExecutorLoop, dst: ExecutorLoop, shared: set[str]) -> bool:
    """Whether rebalancing may move a waiting request from src to dst: it fits dst, and no sibling it shares
    a prompt with stays behind on src (`shared`: the requests whose prompt a sibling on src shares)."""
    if not dst.fits(request) or request.request_id in shared:
        return False
    return not (request.share_prompt_with and src.holds(request.share_prompt_with))


def load_score(running: int, waiting: int) -> int:
    """vLLM's data parallel score: a waiting request weighs four running ones."""
    return 4 * waiting + running


class ExecutorPool:
    """The engine core's executors: the same surface as one ExecutorLoop (add/abort/finish/abort_all/ready/
    describe/metrics) over a changing set of executors."""

    def __init__(self, pool_config: PoolConfig, core_config: CoreConfig, max_queue_len: int,
                 make_loop: LoopFactory | None = None, metrics_model_name: str | None = None,
                 resolver: Resolver | None = None) -> None:
        self.config = pool_config
        self.targets: list[ExecutorTarget] = [parse_target(t) for t in pool_config.executors]
        self.core_config = core_config
        self.max_queue_len = max_queue_len
        self.make_loop = make_loop or (lambda address, metrics: ExecutorLoop(core_config, address, max_queue_len,
                                                                           metrics=metrics))
        self.metrics_model_name = metrics_model_name
        self.resolver = resolver or Resolver(pool_config.hosts_file)
        self.members: dict[str, Member] = {}
        self.describe: executor_pb2.DescribeResponse | None = None
        self.metrics: EngineMetrics | None = None
        self.ready = asyncio.Event()
        self.on_ready_change: Callable[[bool], object] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._refresh_now = asyncio.Event()
        self._tie_turn = 0  # equal executors take new requests in turn, not the first one every time

    # ---- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the executors and start them; return once one serves."""
        await self.refresh()
        self._tasks = [asyncio.create_task(self._membership_loop(), name="pool-membership"),
                       asyncio.create_task(self._rebalance_loop(), name="pool-rebalance")]
        await self.ready.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.gather(*(self._close(m) for m in list(self.members.values())))

    def refresh_soon(self) -> None:
        """Re-resolve membership and re-read the drain file now (SIGHUP)."""
        self._refresh_now.set()

    async def _membership_loop(self) -> None:
        while True:
            self._refresh_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refresh_now.wait(), self.config.resolve_interval)
            try:
                await self.refresh()
            except Exception:
                log.exception("refreshing the executor pool failed; keeping the current members")

    async def refresh(self) -> None:
        wanted = await self.resolver.resolve(self.targets)
        drained = await self._drain_list()
        for address in wanted - self.members.keys():
            self._join(address)
        for address, member in list(self.members.items()):
            leaving, draining = address not in wanted, address in drained
            if (leaving, draining) != (member.leaving, member.draining):
                log.info("executor %s: %s", address, "leaving: draining then closing" if leaving else
                         "draining (in --executor-drain-file)" if draining else "serving again")
            member.leaving, member.draining = leaving, draining
            if not member.serving:
                self._move_waiting(member)
            if member.leaving and member.loop.idle():
                await self._close(member)
        self._update_ready()

    async def _drain_list(self) -> set[str]:
        path = self.config.drain_file
        if not path:
            return set()
        try:
            lines = Path(path).read_text().splitlines()
        except FileNotFoundError:
            return set()
        targets = []
        for line in lines:
            text = line.split("#", 1)[0].strip()
            if text:
                try:
                    targets.append(parse_target(text))
                except ValueError as e:
                    log.warning("--executor-drain-file %s: %s", path, e)
        return await self.resolver.resolve(targets)

    def _join(self, address: str) -> None:
        loop = self.make_loop(address, self.metrics)
        loop.admit = self._admit
        member = self.members[address] = Member(loop)
        loop.on_ready_change = lambda ready: self._member_ready(member, ready)
        member.task = asyncio.create_task(loop.start(), name=f"executor-{address}")
        log.info("executor %s joins the pool (%d members)", address, len(self.members))

    async def _close(self, member: Member) -> None:
        address = member.loop.label
        self.members.pop(address, None)
        self._move_waiting(member)
        if member.task is not None and not member.task.done():
            member.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await member.task
        await member.loop.stop()
        if self.metrics is not None:
            self.metrics.forget_executor(address)
        log.info("executor %s left the pool (%d members)", address, len(self.members))
        self._update_max_model_len()
        self._update_ready()

    def _admit(self, describe: executor_pb2.DescribeResponse) -> str:
        """Every executor serves the pool's model: the first one described sets it."""
        ref = self.describe
        if ref is None:
            self.describe = describe
            self.metrics = EngineMetrics(self.metrics_model_name or describe.model_id)
            for member in self.members.values():
                member.loop.metrics = self.metrics
            return ""
        if describe.model_id != ref.model_id or describe.vocab_size != ref.vocab_size:
            return (f"it serves model {describe.model_id!r} (vocab {describe.vocab_size}) but the pool serves "
                    f"{ref.model_id!r} (vocab {ref.vocab_size}); every executor must serve the same model")
        return ""

    def _update_max_model_len(self) -> None:
        """The pool's description carries its members' largest max_model_len: requests are validated against
        it and placed where they fit. Front-ends hear of a change as a status change."""
        lengths = [e.describe.max_model_len for e in self._loops() if e.describe is not None]
        if self.describe is None or not lengths or max(lengths) == self.describe.max_model_len:
            return
        describe = executor_pb2.DescribeResponse()
        describe.CopyFrom(self.describe)
        describe.max_model_len = max(lengths)
        self.describe = describe
        log.info("pool max_model_len is now %d", describe.max_model_len)
        if self.on_ready_change is not None and self.ready.is_set():
            self.on_ready_change(True)

    def _member_ready(self, member: Member, ready: bool) -> None:
        if ready:
            self._update_max_model_len()
            self._adopt_orphans()
        else:
            self._move_waiting(member)
        self._update_ready()

    def _update_ready(self) -> None:
        for m in self.members.values():
            if m.loop.series is not None:
                m.loop.series.serving.set(1 if m.serving else 0)
        serving = any(m.serving for m in self.members.values())
        if serving == self.ready.is_set():
            return
        if serving:
            self.ready.set()
        else:
            self.ready.clear()
        log.info("pool %s (%d members)", "serving" if serving else "has no serving executor", len(self.members))
        if self.on_ready_change is not None:
            self.on_ready_change(serving)

    # ---- placement and moves ----------------------------------------------------------------------------

    def serving(self) -> list[ExecutorLoop]:
        return [m.loop for m in self.members.values() if m.serving]

    def choose(self, request: Request) -> ExecutorLoop | None:
        candidates = [e for e in self.serving() if e.fits(request)]
        sibling = self._owner(request.share_prompt_with) if request.share_prompt_with else None
        if sibling is not None and sibling in candidates:
            return sibling
        if len(candidates) <= 1:
            return candidates[0] if candidates else None
        stats = [e.load() for e in candidates]
        loads = [load_score(running, waiting) for running, waiting, _ in stats]
        lo, hi = min(loads), max(loads)
        if not (hi - lo > BALANCE_ABS and hi > BALANCE_REL * lo):
            cached = [e.cached_prefix_tokens(request) for e in candidates]
            best = max(range(len(candidates)), key=lambda i: (cached[i], -loads[i]))
            if cached[best] > 0 and cached[best] >= CACHE_THRESHOLD * request.num_prompt_tokens:
                return candidates[best]
        turn = self._tie_turn
        self._tie_turn += 1
        best = min(range(len(candidates)), key=lambda i: (loads[i], stats[i][2], (i - turn) % len(candidates)))
        return candidates[best]

    def _place(self, stream: RequestStream) -> bool:
        """Queue a moved request at the head of the chosen executor's queue: it waited (or ran) already."""
        loop = self.choose(stream.request)
        if loop is None:
            return False
        loop.adopt(stream, front=True)
        return True

    def _move_waiting(self, member: Member) -> None:
        """Hand a member's waiting requests to serving executors (all of its requests are waiting once its
        executor is lost). Requests with nowhere to go stay where they are until an executor serves."""
        if not self.serving():
            return
        moved = member.loop.release_waiting()
        for stream in reversed(moved):  # each goes to the front: newest first keeps the order
            if not self._place(stream):
                member.loop.adopt(stream, front=True)
        if moved:
            log.info("moved %d waiting requests off executor %s", len(moved), member.loop.label)

    def _adopt_orphans(self) -> None:
        for member in list(self.members.values()):
            if not member.serving and not member.loop.idle():
                self._move_waiting(member)

    async def _rebalance_loop(self) -> None:
        while True:
            await asyncio.sleep(REBALANCE_INTERVAL_S)
            self.rebalance()

    def rebalance(self) -> None:
        """Move waiting requests (new or preempted for recompute) from a backed-up executor to one with room:
        this is how a joining executor takes work from a queue that was placed before it came."""
        loops = self.serving()
        if len(loops) < 2:
            return
        for dst in loops:
            running, waiting, _ = dst.load()
            room = dst.max_num_seqs - running - waiting
            if waiting or room <= 0:
                continue
            src = max(loops, key=lambda e: e.load()[1])
            backlog = src.load()[1]
            if src is dst or backlog == 0:
                return
            shared = {s.request.share_prompt_with for s in src.streams.values() if s.request.share_prompt_with}
            accept = partial(movable, src=src, dst=dst, shared=shared)
            for stream in src.release_waiting(min(room, (backlog + 1) // 2), accept):
                dst.adopt(stream)

    # ---- the ExecutorLoop surface the service uses ------------------------------------------------------------

    def add(self, request: Request, queue: asyncio.Queue[RequestDelta], stop_strings: bool = False
            ) -> RequestStream:
        if sum(e.load()[1] for e in self._loops()) >= self.max_queue_len:
            raise QueueFull(f"waiting queue is full ({self.max_queue_len} requests)")
        if self._owner(request.request_id) is not None:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        loop = self.choose(request) if self.serving() else self._waiting_room(request)
        if loop is None:
            need = request.num_prompt_tokens + request.sampling.max_tokens
            raise QueueFull("no executor is serving" if not self.serving() else
                            f"no serving executor's max_model_len holds prompt + max_tokens ({need} tokens); "
                            "retry later")
        return loop.add(request, queue, stop_strings)

    def _waiting_room(self, request: Request) -> ExecutorLoop | None:
        """With no executor serving: a member reconnecting to the executor it lost (not draining or leaving), where
        a new request waits as the member's own requests do, for that executor or for another to serve
        (_adopt_orphans), at most --executor-wait-timeout; None where there is none its executor fits."""
        return next((m.loop for m in self.members.values()
                     if not (m.draining or m.leaving) and m.loop.reconnecting() and m.loop.fits(request)), None)

    def _loops(self) -> list[ExecutorLoop]:
        return [m.loop for m in self.members.values()]

    def _owner(self, request_id: str) -> ExecutorLoop | None:
        for loop in self._loops():
            if request_id in loop.streams:
                return loop
        return None

    def _holder(self, request_id: str) -> ExecutorLoop | None:
        return next((e for e in self._loops() if e.holds(request_id)), None)

    def abort(self, request_id: str) -> None:
        loop = self._holder(request_id)
        if loop is not None:
            loop.abort(request_id)

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        loop = self._holder(request_id)
        if loop is not None:
            loop.finish(request_id, reason, error)

    def abort_all(self, message: str, reason: FinishReason = FinishReason.ABORTED) -> int:
        return sum(e.abort_all(message, reason) for e in self._loops())

    def idle(self) -> bool:
        return all(e.idle() for e in self._loops())

    async def wait_idle(self) -> None:
        while not self.idle():
            await asyncio.gather(*(e.became_idle.wait() for e in self._loops() if not e.idle()))
            await asyncio.sleep(0.01)
