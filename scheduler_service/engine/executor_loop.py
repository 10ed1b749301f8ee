"""The engine loop: schedule, execute on the executor, update, route deltas to request streams."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import grpc

from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult, RequestDelta, SchedulerOutput, StepDeltas
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.speculative import SpecMethod
from scheduler_service.engine.executor_link import ExecutorConnection, ExecutorLost
from scheduler_service.engine.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    CompileFailure,
    GrammarCompiler,
    RequestGrammar,
    step_bitmasks,
)
from scheduler_service.engine.grammar_child import IdleProcesses
from scheduler_service.engine.metrics import EngineMetrics, ExecutorSeries
from scheduler_service.messages import QueueFull, settled_by_frontend

log = logging.getLogger("pagedserve.engine")


@dataclass(slots=True)
class RequestStream:
    request: Request
    queue: asyncio.Queue[RequestDelta]
    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    executor_unavailable: bool = False  # ended because no executor came back within the wait timeout
    invalid_argument: bool = False  # ended because its constraint does not compile (the client's fault)
    # The front-end matches stop strings: a LENGTH finish may still be answered `stop` (the last allowed
    # token completed one), so it is counted when the front-end settles it with finish().
    stop_strings: bool = False
    grammar: RequestGrammar | None = None  # structured outputs: the sequence's matcher (it moves with the stream)


def executor_limits(describe: executor_pb2.DescribeResponse) -> ExecutorLimits:
    return ExecutorLimits(block_size=describe.block_size, num_device_blocks=describe.num_device_blocks,
                       num_swap_blocks=describe.num_swap_blocks, max_model_len=describe.max_model_len,
                       eos_token_ids=tuple(describe.eos_token_ids),
                       max_num_draft_tokens=describe.capabilities.max_num_draft_tokens,
                       num_window_groups=describe.capabilities.kv_window_groups,
                       window=describe.capabilities.kv_window,
                       window_ring=describe.capabilities.kv_window_ring,
                       window_only=describe.capabilities.kv_window_only,
                       max_num_model_draft_tokens=describe.capabilities.max_num_model_draft_tokens)

EXECUTOR_LOAD_WARN_S = 120.0
"""An executor that has not answered Describe for this long is warned about (before: it is loading, quietly)."""


def step_budgets(config: CoreConfig, describe: executor_pb2.DescribeResponse) -> CoreConfig:
    """The scheduler's per-step budgets for this executor: its own flags, capped by the limits the executor
    advertises in Describe (0: not advertised), so that no step it sends is refused for its size."""
    caps = describe.capabilities
    budgets = {name: min(getattr(config, name), cap) for name, cap in (
        ("max_num_batched_tokens", caps.max_num_batched_tokens), ("max_num_seqs", caps.max_num_seqs),
        ("num_lookahead_slots", caps.max_num_lookahead_slots)) if cap and getattr(config, name) > cap}
    for name, value in budgets.items():
        log.warning("--%s %d is more than the executor allows per step; using %d", name.replace("_", "-"),
                    getattr(config, name), value)
    return replace(config, **budgets) if budgets else config


def calls(batch: list[RequestStream]) -> list[list[RequestStream]]:
    """The streams grouped by the call they belong to (an n > 1 call's sequences share the prompt of its first),
    in the order the calls came."""
    groups: dict[str, list[RequestStream]] = {}
    for stream in batch:
        request = stream.request
        groups.setdefault(request.share_prompt_with or request.request_id, []).append(stream)
    return list(groups.values())


class ExecutorLoop:
    """One executor's step loop and its own Scheduler (one block domain). ExecutorPool drives several."""

    def __init__(self, core_config: CoreConfig, executor_address: str, max_queue_len: int,
                 metrics_model_name: str | None = None, credentials: grpc.ChannelCredentials | None = None,
                 step_timeout: float | None = None, *, executor_wait_timeout: float = 30.0,
                 executor_secret: str | None = None, metrics: EngineMetrics | None = None,
                 steps_in_flight: int = 2, grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S,
                 grammar_processes: IdleProcesses | None = None) -> None:
        self.core_config = core_config
        self.label = executor_address
        self.connection = ExecutorConnection(executor_address, credentials, step_timeout, executor_secret)
        self.executor_wait_timeout = executor_wait_timeout
        self.load_warn_s = EXECUTOR_LOAD_WARN_S
        self._lost_since: float | None = None  # when the executor was lost; None while steps succeed
        self._losses = 0  # losses in a row without a successful step: sets the reconnect back-off
        self.max_queue_len = max_queue_len
        self.metrics_model_name = metrics_model_name
        self.describe: executor_pb2.DescribeResponse | None = None
        self.scheduler: Scheduler | None = None
        self.metrics: EngineMetrics | None = metrics
        self.series: ExecutorSeries | None = None
        self.streams: dict[str, RequestStream] = {}
        self._unsettled: dict[str, tuple[RequestStream, float]] = {}  # LENGTH finishes the front-end settles
        self.ready = asyncio.Event()
        self.became_idle = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps_in_flight = steps_in_flight
        self._pending: deque[SchedulerOutput] = deque()  # sent, result not read yet (async scheduling)
        # grammar_processes: started compile processes to take and give back (tests share them; the engine core none)
        self.grammar_compiler = GrammarCompiler(grammar_compile_timeout, grammar_processes)
        self._constrained: dict[str, RequestGrammar] = {}  # structured outputs: the scheduler's constrained requests
        self._compiling: set[asyncio.Task[None]] = set()
        self._to_compile: list[RequestStream] = []
        # The open requests waiting outside the scheduler for their grammar: they count as waiting requests, so that
        # --max-queue-len holds for constrained requests too (each distinct spec a compile of up to its deadline)
        self._awaiting_grammar: set[str] = set()
        self._masks_follow: set[int] = set()  # steps sent whose masks are still to send
        self._unrouted = StepDeltas()
        self.on_ready_change: Callable[[bool], object] | None = None
        # The pool's check of a described executor: "" to accept, else why it is refused.
        self.admit: Callable[[executor_pb2.DescribeResponse], str] | None = None

    async def start(self) -> None:
        await self._connect()
        self._task = asyncio.create_task(self._run(), name="engine-loop")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine loop died: %r; failing every request and refusing new ones", task.exception())
        self.ready.clear()
        if self.on_ready_change is not None:
            self.on_ready_change(False)
        self.abort_all("the scheduler's engine loop stopped; see its log", FinishReason.ERROR)

    def idle(self) -> bool:
        return self.scheduler is None or not self.scheduler.has_unfinished()

    @property
    def max_num_seqs(self) -> int:
        """Most running requests: --max-num-seqs, capped by what the executor allows per step."""
        config = self.scheduler.config if self.scheduler is not None else self.core_config
        return config.max_num_seqs

    async def _connect(self) -> None:
        describe = await self._describe_admitted()
        self.describe = describe
        max_steps = describe.capabilities.max_num_steps
        if max_steps and self.core_config.num_scheduler_steps > max_steps:
            log.error("--num-scheduler-steps %d exceeds the executor's max_num_steps %d: it will refuse every "
                      "multi-step decode", self.core_config.num_scheduler_steps, max_steps)
        limits = executor_limits(describe)
        spec = self.core_config.speculative_config
        if spec is not None and spec.method is SpecMethod.DRAFT_MODEL and not limits.max_num_model_draft_tokens:
            log.error("--speculative-config.method 'draft_model' needs an executor with a draft model (executor "
                      "--draft-model DIR: Describe.capabilities.max_num_model_draft_tokens > 0); %s has none, so it "
                      "is sent plain steps without speculation", self.connection.address)
        config = step_budgets(self.core_config, describe)
        if self.scheduler is None:
            self.scheduler = Scheduler(config, limits)
        else:
            self.scheduler.config = config
            self.scheduler.set_executor_limits(limits)
        if self.metrics is None:
            self.metrics = EngineMetrics(self.metrics_model_name or describe.model_id)
        self.series = self.metrics.executor_series(self.label)
        self.series.device_blocks.set(describe.num_device_blocks)
        self.series.startup.set(describe.startup_seconds)
        self.metrics.set_capacity(self.label, describe.num_device_blocks, describe.num_swap_blocks)
        self.ready.set()
        if self.on_ready_change is not None:
            self.on_ready_change(True)
        started = f" started in {describe.startup_seconds:.1f} s" if describe.startup_seconds else ""
        log.info("executor %s: model=%s blocks=%d swap_blocks=%d block_size=%d max_model_len=%d%s",
                 self.connection.address, describe.model_id, describe.num_device_blocks,
                 describe.num_swap_blocks, describe.block_size, describe.max_model_len, started)

    async def _describe_admitted(self) -> executor_pb2.DescribeResponse:
        """Describe the executor, retrying with backoff until it answers and the pool accepts it. An executor
        that does not answer yet is most likely loading its model: one INFO line says so, and warnings (one
        every 10 attempts) start only once it has not answered for load_warn_s."""
        delay, attempts, late, since = 0.05, 0, 0, time.monotonic()
        while True:
            self._fail_if_lost_too_long()
            asked = time.monotonic()
            try:
                describe = await self.connection.describe(timeout=self._patience(5.0))
                if attempts:
                    log.info("executor %s answered after %.1f s of loading", self.connection.address,
                             time.monotonic() - since)
                refusal = self.admit(describe) if self.admit is not None else ""
                if not refusal:
                    return describe
                log.error("executor %s refused: %s; asking again in 30 s", self.label, refusal)
                await asyncio.sleep(self._patience(30.0))
                continue
            except grpc.aio.AioRpcError as e:
                waited = time.monotonic() - since
                if attempts == 0:
                    log.info("executor %s loading, %.1f s (not answering Describe yet: %s %s); waiting, with a "
                             "warning after %.0f s", self.connection.address, waited, e.code().name, e.details(),
                             self.load_warn_s)
                elif waited >= self.load_warn_s:
                    if late % 10 == 0:
                        log.warning("executor %s not answering Describe for %.0f s (%s: %s); retrying with "
                                    "backoff", self.connection.address, waited, e.code().name, e.details())
                    late += 1
                attempts += 1  # a loading executor holds the call until ready or near its deadline: ask again
                await asyncio.sleep(self._patience(max(0.0, delay - (time.monotonic() - asked))))  # at once then
                delay = min(delay * 2, 2.0)

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():  # a loop that died was logged by _loop_ended
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.grammar_compiler.close()  # and its compile process
        await self.connection.close()

    def add(self, request: Request, queue: asyncio.Queue[RequestDelta], stop_strings: bool = False
            ) -> RequestStream:
        sched = self._sched()
        if len(sched.waiting) + len(self._awaiting_grammar) >= self.max_queue_len:
            raise QueueFull(f"waiting queue is full ({self.max_queue_len} requests)")
        stream = RequestStream(request, queue, stop_strings=stop_strings)
        self.streams[request.request_id] = stream
        if request.wants_prompt_logprobs and self._lacks_prompt_logprobs():
            message = ("sampling.prompt_logprobs: this executor does not compute prompt logprobs "
                       "(Describe.capabilities.prompt_logprobs)")
            asyncio.get_running_loop().call_soon(self._route, [RequestDelta(request.request_id, [],
                                                                            FinishReason.ERROR, message)])
            return stream
        if request.sampling.constraint is not None:
            self._compile_then_add(stream)
            return stream
        sched.add_request(request)
        self.became_idle.clear()
        self._wake.set()
        return stream

    def _lacks_prompt_logprobs(self) -> bool:
        """The connected executor does not compute prompt logprobs (none connected yet: not known to lack them)."""
        return self.describe is not None and not self.describe.capabilities.prompt_logprobs

    def adopt(self, stream: RequestStream, front: bool = False) -> None:
        """Take over a request another executor's scheduler released (no queue limit: it was admitted)."""
        self._sched().add_request(stream.request, front)
        self.streams[stream.request.request_id] = stream
        if stream.grammar is not None:
            self._constrained[stream.request.request_id] = stream.grammar
        self.became_idle.clear()
        self._wake.set()

    def release(self, request_id: str) -> RequestStream | None:
        """Hand a WAITING request back to the pool (to move it); None if it is running here or unknown."""
        if self.scheduler is None or self.scheduler.release(request_id) is None:
            return None
        return self.streams.pop(request_id, None)

    def _compile_then_add(self, stream: RequestStream) -> None:
        """A constrained request joins the scheduler once its grammar is compiled (off the event loop). The
        sequences of an n > 1 request added in one turn of the event loop compile together and join together, so
        they arrive in the scheduler as one group, as unconstrained ones do."""
        self._to_compile.append(stream)
        self._awaiting_grammar.add(stream.request.request_id)
        if len(self._to_compile) == 1:
            asyncio.get_running_loop().call_soon(self._compile_batch)

    def _compile_batch(self) -> None:
        """One task per call: a call's sequences join together once their grammars compiled, without waiting for
        the other calls' of the turn (another caller's costly specs, in the same message from a front-end)."""
        batch, self._to_compile = self._to_compile, []
        for call in calls(batch):
            task = asyncio.get_running_loop().create_task(self._add_compiled(call), name="grammar-compile")
            self._compiling.add(task)
            task.add_done_callback(self._compiling.discard)

    async def _add_compiled(self, batch: list[RequestStream]) -> None:
        results: list[RequestGrammar | CompileFailure]
        if self.core_config.num_scheduler_steps > 1:
            results = [CompileFailure("structured outputs need --num-scheduler-steps 1 (a mask holds for one token)")
                       ] * len(batch)
        elif self.describe is None:
            results = [CompileFailure("no executor described")] * len(batch)
        else:
            constraints = [s.request.sampling.constraint for s in batch]
            wanted = [functools.partial(self._still_open, s) for s in batch]
            results = await self.grammar_compiler.matchers(self.describe, [c for c in constraints if c is not None],
                                                           wanted, [s.request.owner for s in batch])
        for stream, result in zip(batch, results, strict=True):
            rid = stream.request.request_id
            if self.streams.get(rid) is not stream:  # ended (or moved) while it compiled
                continue
            self._awaiting_grammar.discard(rid)
            if isinstance(result, CompileFailure):
                stream.invalid_argument = result.invalid
                self._route([RequestDelta(rid, [], FinishReason.ERROR, result.message)])
                continue
            refused = resumed_output_refused(result, stream.request.output_token_ids)
            if refused:
                stream.invalid_argument = True  # the client sent those tokens: INVALID_ARGUMENT, not a failure
                self._route([RequestDelta(rid, [], FinishReason.ERROR, refused)])
                continue
            stream.grammar = self._constrained[rid] = result
            self._sched().add_request(stream.request)
        self.became_idle.clear()
        self._wake.set()

    def release_waiting(self, limit: int | None = None, accept: Callable[[Request], bool] | None = None
                        ) -> list[RequestStream]:
        """Hand back up to `limit` WAITING requests that `accept` takes (all by default), oldest first: they
        gain most from a move."""
        if self.scheduler is None:
            return []
        ids = self.scheduler.waiting_ids()
        if accept is not None:
            streams = self.streams
            ids = [rid for rid in ids if rid in streams and accept(streams[rid].request)]
        released = [stream for stream in (self.release(rid) for rid in ids[:limit]) if stream is not None]
        if released:
            self._refresh_gauges()
        return released

    def load(self) -> tuple[int, int, float]:
        """(running, waiting, device KV usage) of this executor's scheduler; waiting counts the requests waiting for
        their grammar to compile."""
        if self.scheduler is None:
            return 0, 0, 0.0
        s = self.scheduler.stats()
        return s.num_running + s.num_swapped, s.num_waiting + len(self._awaiting_grammar), s.device_usage

    def reconnecting(self) -> bool:
        """It lost its executor and its loop is connecting again: a request added now waits for it, at most
        executor_wait_timeout from its arrival (_fail_if_lost_too_long), as the requests it held do."""
        return self._lost_since is not None and self._task is not None and not self._task.done()

    def fits(self, request: Request) -> bool:
        """Whether this executor's max_model_len holds the request's prompt and all its max_tokens."""
        d = self.describe
        return d is not None and request.num_prompt_tokens + request.sampling.max_tokens <= d.max_model_len

    def cached_prefix_tokens(self, request: Request) -> int:
        return self.scheduler.cached_prefix_tokens(request) if self.scheduler is not None else 0

    def _still_open(self, stream: RequestStream) -> bool:
        """Whether the stream is still this loop's (read on the compile thread: one dict lookup)."""
        return self.streams.get(stream.request.request_id) is stream

    def abort(self, request_id: str) -> None:
        self.finish(request_id, FinishReason.ABORTED)
        self._wake.set()

    def holds(self, request_id: str) -> bool:
        """Whether finish() has anything to do for this id: an open stream, or a finish to settle."""
        return request_id in self.streams or request_id in self._unsettled

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None:
        """End a request for a reason found outside the core: a stop string, a cancelled call, shutdown.
        For a LENGTH finish the front-end settles, this counts it: `stop` if the front-end answered that
        (a stop string completed by the last allowed token), else `length`."""
        self._route_unrouted()  # a read step's deltas reach this stream now, never a later request of the same id
        unsettled = self._unsettled.pop(request_id, None)
        if unsettled is not None:
            done, ended = unsettled
            self._count_finish(done, FinishReason.STOPPED if reason is FinishReason.STOPPED
                               else FinishReason.LENGTH, "", ended)
            return
        stream = self.streams.pop(request_id, None)
        self._awaiting_grammar.discard(request_id)
        if self.scheduler is not None:
            self.scheduler.finish(request_id, reason)
            self._refresh_gauges()
        if stream is not None:
            self._count_finish(stream, reason, error, time.monotonic())

    def _count_finish(self, stream: RequestStream, reason: FinishReason, error: str, now: float) -> None:
        self._log_finish(stream, reason, error, now)
        if self.metrics is not None:
            self.metrics.on_finish(reason, now - stream.arrival)

    def abort_all(self, message: str, reason: FinishReason = FinishReason.ABORTED) -> int:
        """End every unfinished request, telling each stream why (and count the unsettled as `length`)."""
        for request_id in list(self._unsettled):
            self.finish(request_id, FinishReason.LENGTH)
        streams = list(self.streams.values())
        for stream in streams:
            self.finish(stream.request.request_id, reason, message)
            stream.queue.put_nowait(RequestDelta(stream.request.request_id, [], reason, message))
        return len(streams)

    def _refresh_gauges(self) -> None:
        if self.metrics is not None and self.scheduler is not None:
            self.metrics.observe_stats(self.scheduler.stats(), self.label)

    def _sched(self) -> Scheduler:
        if self.scheduler is None:
            raise RuntimeError("engine not started")
        return self.scheduler

    async def _run(self) -> None:
        sched = self._sched()
        plain_step = self._step_async if self.core_config.async_scheduling else self._step
        while True:
            if not sched.has_unfinished() and not self._pending:
                self.became_idle.set()
                if await self._sleep_until_work_or_loss():
                    await self._recover("connection lost while idle")
                    continue
            serial = self._holds_constrained() and not (self.core_config.async_scheduling and self._defers_masks())
            step = self._step_serial if serial else plain_step
            try:
                await step(sched)
            except (asyncio.CancelledError, ExecutorLost):
                raise
            except Exception:
                log.exception("engine step failed; failing the requests in flight and resetting the executor")
                self.abort_all("internal error in the scheduler; see its log", FinishReason.ERROR)
                await self._recover("engine step failed")

    async def _step_async(self, sched: Scheduler) -> None:
        """Async scheduling: keep steps_in_flight steps written to the Execute stream before reading the
        oldest one's result, so the executor finds the next step queued when it finishes one and never
        waits for schedule()/update()/routing (Scheduler._schedule_ahead). A step's deltas are routed
        after the next step is sent: routing is off the executor's critical path."""
        t0 = time.perf_counter()
        out = sched.schedule()
        core = time.perf_counter() - t0
        if out.needs_executor:
            try:
                await self._send_async(out)
            except ExecutorLost as e:
                await self._lose(str(e), out)
                return
            self._pending.append(out)
        else:
            self._route(sched.update(out, ExecutorResult()))
        self._route_unrouted()
        executor = None
        if self._pending and (len(self._pending) >= self.steps_in_flight or not out.needs_executor):
            prev = self._pending[0]
            t1 = time.perf_counter()
            try:
                result = await self.connection.receive(prev)
            except ExecutorLost as e:
                await self._lose(str(e), prev)
                return
            t2 = time.perf_counter()
            self._executor_answered()
            self._pending.popleft()
            self._unrouted = sched.update(prev, result)
            if self._pending and self._pending[0].step_id in self._masks_follow:
                try:
                    await self._send_following_masks(self._pending[0])
                except ExecutorLost as e:
                    await self._lose(str(e))
                    return
            executor = t2 - t1
            core += time.perf_counter() - t2
        if self._unrouted and not self._pending:
            self._route_unrouted()
        self._observe(core, executor)
        if not out.scheduled and not self._pending and executor is None:  # a result just in: schedule at once
            await self._idle()
        else:
            await asyncio.sleep(0)

    def _defers_masks(self) -> bool:
        """Whether constrained steps keep async scheduling: the executor takes a step's masks in the message after it
        (running the forward pass meanwhile), and only one step is ever in flight ahead of the one being read."""
        d = self.describe
        return d is not None and d.capabilities.deferred_token_bitmask and self.steps_in_flight == 2

    async def _send_async(self, out: SchedulerOutput) -> None:
        """Send a step under async scheduling. A step with constrained requests gets its masks now if no step is in
        flight before it; else they follow once the step before it is read (_send_following_masks)."""
        if not self._constrained or not any(w.request.request_id in self._constrained for w in out.scheduled):
            await self.connection.send(out)
        elif not self._pending:
            await self.connection.send(out, self._step_masks(out))
        else:
            self._masks_follow.add(out.step_id)
            await self.connection.send(out, follow=True)

    async def _send_following_masks(self, out: SchedulerOutput) -> None:
        self._masks_follow.discard(out.step_id)
        masks = self._step_masks(out) or executor_pb2.TokenBitmasks()
        await self.connection.send_masks(out.step_id, masks)

    def _holds_constrained(self) -> bool:
        """Whether a constrained request is among the scheduler's (those that ended are forgotten here)."""
        constrained = self._constrained
        if constrained:
            for rid in [rid for rid in constrained if rid not in self.streams]:
                del constrained[rid]
        return bool(constrained)

    async def _step_serial(self, sched: Scheduler) -> None:
        """With a constrained request the steps run one at a time: its next mask needs its last token. Steps
        still in flight from async scheduling are read first, one per call."""
        if not self._pending:
            await self._step(sched)
            return
        prev = self._pending[0]
        try:
            result = await self.connection.receive(prev)
        except ExecutorLost as e:
            await self._lose(str(e), prev)
            return
        self._executor_answered()
        self._pending.popleft()
        self._route_unrouted()
        self._route(sched.update(prev, result))

    async def _execute(self, out: SchedulerOutput) -> ExecutorResult:
        masks = self._step_masks(out)
        if masks is None:
            return await self.connection.execute(out)
        await self.connection.send(out, masks)
        return await self.connection.receive(out)

    def _step_masks(self, out: SchedulerOutput) -> executor_pb2.TokenBitmasks | None:
        """The step's token masks (None without constrained requests); a request whose output its grammar
        refused (an executor that ignored a mask) fails, and one whose grammar reached a dead end fails as the
        client's error."""
        if not self._constrained or self.describe is None:
            return None
        step = step_bitmasks(out, self._constrained, self.describe.vocab_size)
        for rid, error in step.dead_ends.items():
            if (stream := self.streams.get(rid)) is not None:
                stream.invalid_argument = True  # the client's grammar: INVALID_ARGUMENT / 400 naming the field
            self._fail(rid, error)
        for rid, error in step.refused.items():
            self._fail(rid, error)
        for rid in step.complete:
            self._sched().finish(rid, FinishReason.STOPPED)
            self._route([RequestDelta(rid, [], FinishReason.STOPPED)])
        return step.masks

    def _fail(self, rid: str, error: str) -> None:
        self._sched().finish(rid, FinishReason.ERROR, error)
        self._route([RequestDelta(rid, [], FinishReason.ERROR, error)])

    def _route_unrouted(self) -> None:
        if self._unrouted:
            deltas, self._unrouted = self._unrouted, StepDeltas()
            self._route(deltas)

    async def _lose(self, reason: str, *outs: SchedulerOutput) -> None:
        self._route_unrouted()
        for out in {id(o): o for o in (*outs, *self._pending)}.values():
            self._route(out.rejected)
        await self._recover(reason)

    async def _step(self, sched: Scheduler) -> None:
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        result = ExecutorResult()
        if out.needs_executor:
            try:
                result = await self._execute(out)
            except ExecutorLost as e:
                self._route(out.rejected)
                await self._recover(str(e))
                return
            self._executor_answered()
        t2 = time.perf_counter()
        deltas = sched.update(out, result)
        t3 = time.perf_counter()
        self._route(deltas)
        self._observe(t1 - t0 + t3 - t2, t2 - t1 if out.needs_executor else None)
        if not out.scheduled:
            await self._idle()
        else:
            await asyncio.sleep(0)

    async def _sleep_until_work_or_loss(self) -> bool:
        """Wait for a new request; True if the executor connection dropped first."""
        self._wake.clear()
        woken = asyncio.create_task(self._wake.wait())
        lost = asyncio.create_task(self.connection.wait_until_lost())
        try:
            await asyncio.wait((woken, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (woken, lost):
                task.cancel()
        return lost.done() and not lost.cancelled() and not woken.done()

    async def _idle(self) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=0.005)

    async def _recover(self, reason: str) -> None:
        sched = self._sched()
        if self._lost_since is None:
            self._lost_since = time.monotonic()
        if sched.running or sched.swapped:
            log.error("executor stream lost (%s): requeueing %d running and %d swapped requests for recompute",
                      reason, len(sched.running), len(sched.swapped))
        elif self._losses % 10 == 0:
            log.warning("executor connection lost (%s); reconnecting", reason)
        self.ready.clear()
        self._pending.clear()
        self._masks_follow.clear()
        self._unrouted = StepDeltas()
        sched.reset_executor()
        self._refresh_gauges()
        if self.on_ready_change is not None:
            self.on_ready_change(False)
        self.connection.drop_stream()
        if self._losses:
            await asyncio.sleep(min(0.05 * 2 ** min(self._losses, 6), 2.0))
        self._losses += 1
        self._fail_if_lost_too_long()
        await self._connect()

    def _fail_if_lost_too_long(self) -> None:
        """A request waits for a lost executor at most executor_wait_timeout (from the loss, or from its
        arrival if later), then ends UNAVAILABLE."""
        if self._lost_since is None or not self.streams:
            return
        now = time.monotonic()
        expired = [s for s in self.streams.values() if now >= self._deadline(s)]
        for stream in expired:
            stream.executor_unavailable = True
            rid = stream.request.request_id
            message = (f"no executor for {now - max(self._lost_since, stream.arrival):.1f}s (--executor-wait-timeout "
                       f"{self.executor_wait_timeout}s); the request was dropped, retry it")
            self.finish(rid, FinishReason.ERROR, message)
            stream.queue.put_nowait(RequestDelta(rid, [], FinishReason.ERROR, message))
        if expired:
            log.error("executor %s away: failed %d requests that waited --executor-wait-timeout %.1fs",
                      self.connection.address, len(expired), self.executor_wait_timeout)

    def _deadline(self, stream: RequestStream) -> float:
        return max(self._lost_since or 0.0, stream.arrival) + self.executor_wait_timeout

    def _patience(self, seconds: float) -> float:
        """`seconds`, shortened so that requests in flight are failed on time when the executor is away."""
        if self._lost_since is None or not self.streams:
            return seconds
        left = min(self._deadline(s) for s in self.streams.values()) - time.monotonic()
        return min(seconds, max(0.05, left))

    def _executor_answered(self) -> None:
        self._lost_since = None
        self._losses = 0

    def _route(self, deltas: Iterable[RequestDelta]) -> None:
        now = time.monotonic()
        m = self.metrics
        generated = 0
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            if m is not None:
                generated += self._observe_tokens(stream, delta, now, m)
            if delta.finish_reason is not None:
                del self.streams[delta.request_id]
                if settled_by_frontend(delta.finish_reason, stream.stop_strings):
                    self._unsettled[delta.request_id] = (stream, now)
                else:
                    self._count_finish(stream, delta.finish_reason, delta.error, now)
            stream.queue.put_nowait(delta)
        if m is not None:
            if generated:
                m.generation_tokens.inc(generated)
            m.itl.flush()

    def _log_finish(self, stream: RequestStream, reason: FinishReason, error: str, now: float) -> None:
        """The one log line of each finished request, however it finished."""
        req = stream.request
        queue = (req.first_scheduled_time or now) - stream.arrival
        ttft = (stream.first_token - stream.arrival) if stream.first_token is not None else float("nan")
        hit_rate = self.scheduler.prefix_cache_hit_rate() if self.scheduler is not None else 0.0
        drafts = req.drafts
        spec = (f" spec_steps={drafts.steps} mean_accepted_length={drafts.mean_accepted_length:.2f}"
                if drafts is not None and drafts.steps else "")
        log.info("request %s finished: reason=%s prompt_tokens=%d output_tokens=%d cached_tokens=%d queue=%.3fs "
                 "ttft=%.3fs e2e=%.3fs preemptions=%d prefix_cache_hit_rate=%.1f%%%s%s", req.request_id, reason.value,
                 req.num_prompt_tokens, req.num_output_tokens, max(req.num_cached_tokens, 0), queue, ttft,
                 now - stream.arrival, req.num_preemptions, hit_rate, spec, f" error={error!r}" if error else "")

    def _observe_tokens(self, stream: RequestStream, delta: RequestDelta, now: float, m: EngineMetrics) -> int:
        """Latency metrics of one delta; the number of new tokens."""
        n = len(delta.new_token_ids)
        if n:
            if stream.first_token is None:
                stream.first_token = now
                m.ttft.observe(now - stream.arrival)
                m.prompt_tokens.inc(stream.request.num_prompt_tokens)
                scheduled = stream.request.first_scheduled_time
                if scheduled is not None:
                    m.queue_time.observe(max(0.0, scheduled - stream.arrival))
            elif stream.last_token is not None:
                m.itl.observe((now - stream.last_token) / n)
            stream.last_token = now
        return n

    def _observe(self, core_seconds: float, executor_seconds: float | None) -> None:
        m = self.metrics
        if m is None:
            return
        series = self.series
        if series is not None:
            series.step_time.observe(core_seconds)
            if executor_seconds is not None:
                series.executor_step_time.observe(executor_seconds)
            if self.connection.busy_ns:
                series.executor_busy.inc(self.connection.busy_ns / 1e9)
                self.connection.busy_ns = 0
        self._refresh_gauges()


def resumed_output_refused(grammar: RequestGrammar, output: list[int]) -> str:
    """Why a resumed request's tokens (what its client already had) are not an output its grammar allows; "" if
    they are (the matcher has then consumed them). Found later, at its first step, this was blamed on the executor
    ("the executor sampled token ..."): a server failure for a client's wrong resume point."""
    if not output or not grammar.sync(output):
        return ""
    return (f"resume.token_ids: token {output[grammar.consumed]} at output position {grammar.consumed} is not "
            "allowed by the request's structured_outputs")
