"""The Executor gRPC service: a thin shell around a backend and the request table."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, replace
from typing import TextIO

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.activity import StepActivity
from executor_service.auth import SecretInterceptor
from executor_service.backend import Backend, BackendLost, BatchItem, SampleOutput, attended_keys
from executor_service.read_ahead import ReadAhead
from executor_service.state import RequestState, RequestTable
from executor_service.token_masks import DeferredMasks, follow_masks, step_masks
from executor_service.validator import RequestRefused, StepLimits, StepRefused, StepValidator, check_span
from protos.contract import BlockMap
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import EXECUTOR_LINK_OPTIONS, add_port

log = logging.getLogger("pagedserve.executor")
EXECUTOR_VERSION = "pagedserve-executor/0.1"
EXECUTOR_SERVICE = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name
HANDOVER_WAIT_S = 1.0  # how long a new stream waits for the previous one to end before it is refused
LOADING_WAIT_S = 30.0  # the longest a call waits for a loading backend before it is answered UNAVAILABLE
LOADING_ANSWER_S = 0.2  # a waiting call is answered this long before its deadline, so the caller hears "loading"


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """The Executor API over `backend`; with backend None it serves while the backend loads (attach() gives it):
    a Describe or Execute call waits for it up to its deadline (at most LOADING_WAIT_S), then ends UNAVAILABLE
    ("loading"), so a scheduler that asks while the executor loads hears of ready at once, without polling."""

    backend: Backend
    table: RequestTable
    limits: StepLimits
    validator: StepValidator

    def __init__(self, backend: Backend | None, stopping: asyncio.Event | None = None,
                 step_log: TextIO | None = None, limits: StepLimits | None = None) -> None:
        self.stopping = stopping or asyncio.Event()
        self.step_log = step_log
        self.requested_limits = limits or StepLimits()
        self.loaded = asyncio.Event()
        self.loading_since = time.monotonic()
        self._stream_epoch = 0
        self._step_lock = asyncio.Lock()
        self.activity = StepActivity()  # steps in flight: the after-ready work waits for none (activity.py)
        self._owner: str | None = None  # the peer whose Execute stream is open
        self._released = asyncio.Event()
        self._next_message: Callable[[], Awaitable[executor_pb2.StepRequest]] | None = None
        self._resumed_ns = 0
        """When the Execute stream took back control after handing gRPC the last result (perf_counter_ns; 0: no
        result yet): the step log splits the gap before the next step into writing that result and waiting for
        the next message."""
        if backend is not None:
            self.attach(backend)

    def attach(self, backend: Backend) -> None:
        """Serve `backend` from now on (the calls waiting for it go on)."""
        self.backend = backend
        info = backend.info
        self.table = RequestTable(info.num_device_blocks, info.num_swap_blocks, info.block_size,
                                  info.vocab_size, info.max_model_len, info.kv_window_groups, info.kv_window,
                                  info.kv_window_ring, info.kv_window_only)
        limits = self.requested_limits  # drafts only as many as the backend verifies (none: refused)
        self.limits = replace(limits, max_num_draft_tokens=min(limits.max_num_draft_tokens, info.max_num_draft_tokens),
                              max_num_model_draft_tokens=min(limits.max_num_model_draft_tokens,
                                                             info.max_num_model_draft_tokens))
        self.validator = StepValidator(self.table, self.limits, info.max_logprobs)
        self.loaded.set()

    async def _until_loaded(self, context: grpc.aio.ServicerContext) -> None:
        """Return once the backend is attached; end the call UNAVAILABLE if it is not by the call's deadline."""
        if self.loaded.is_set():
            return
        remaining = context.time_remaining()
        wait = LOADING_WAIT_S if remaining is None else min(LOADING_WAIT_S, remaining - LOADING_ANSWER_S)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.loaded.wait(), max(0.0, wait))
        if not self.loaded.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor loading its model "
                                f"({time.monotonic() - self.loading_since:.1f} s so far)")

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.DescribeResponse:
        await self._until_loaded(context)
        info, limits = self.backend.info, self.limits
        return executor_pb2.DescribeResponse(
            model_id=info.model_id, vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
            max_model_len=info.max_model_len, block_size=info.block_size,
            num_device_blocks=info.num_device_blocks, num_swap_blocks=info.num_swap_blocks,
            dtype=info.dtype, device=info.device, tokenizer_json=info.tokenizer_json,
            executor_version=EXECUTOR_VERSION, bos_token_id=info.bos_token_id or 0,
            add_bos_token=info.add_bos_token, chat_template=info.chat_template,
            startup_seconds=info.startup_seconds, startup_phases=dict(info.startup_phases),
            architecture=info.architecture, sliding_windows=list(info.sliding_windows),
            capabilities=executor_pb2.Capabilities(
                swap=True, copy=True, chunked_prefill=True, max_num_steps=limits.max_num_steps,
                max_logprobs=info.max_logprobs, seeded_sampling=True,
                max_num_batched_tokens=limits.max_num_batched_tokens, max_num_seqs=limits.max_num_seqs,
                max_num_lookahead_slots=limits.max_num_lookahead_slots, token_bitmask=True,
                max_num_draft_tokens=min(limits.max_num_draft_tokens, info.max_num_draft_tokens),
                max_num_model_draft_tokens=limits.max_num_model_draft_tokens,
                deferred_token_bitmask=True, kv_window_groups=info.kv_window_groups, kv_window=info.kv_window,
                kv_window_ring=info.kv_window_ring, kv_window_only=info.kv_window_only,
                prompt_logprobs=info.prompt_logprobs))

    async def Execute(self, request_iterator: AsyncIterator[executor_pb2.StepRequest],
                      context: grpc.aio.ServicerContext) -> None:
        """One scheduler at a time: a second stream is refused with FAILED_PRECONDITION while the first is
        open. A scheduler that dies or hangs loses its stream (closed connection, or keepalive pings
        unanswered), and then the next one is accepted. While a step runs, the result of the step before it is
        written (one write in flight, in order) and the next message is read (read_ahead.py): the ~0.6 ms a step
        that gRPC's send and receive took between steps is off the executor's critical path (#29)."""
        peer = context.peer()
        if self._owner is not None and not await self._wait_for_release():
            log.warning("refused an Execute stream from %s: stream %d from %s is still open", peer,
                        self._stream_epoch, self._owner)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this executor already serves a scheduler (stream from {self._owner}); one "
                                "scheduler at a time. It is released when that stream ends or stops answering "
                                "keepalive pings")
        self._owner = peer
        self._released.clear()
        writing: asyncio.Future[None] = done_writing()
        reader: ReadAhead[executor_pb2.StepRequest] | None = None
        try:
            async with self._step_lock:
                self._stream_epoch += 1
                self.table.reset()
            log.info("scheduler %s connected (stream %d); request state cleared", peer, self._stream_epoch)
            reader = ReadAhead(request_iterator.__aiter__())
            self._next_message = reader.next  # the masks of a token_bitmasks_follow step
            try:
                while (step := await self._read_step(reader, context, writing)) is not None:
                    reader.ahead()  # the next message is read while this step runs
                    result = await self._answer(step, context, writing)
                    await writing  # the last result is out before this one is written (order; one write at a time)
                    writing = asyncio.ensure_future(context.write(result))
                    self._resumed_ns = time.perf_counter_ns()
            except Exception:  # the stream ends in error (not cancelled): the result already answered goes out first
                await flushed(writing)
                raise
            await writing
        finally:
            if reader is not None:
                reader.close()
            writing.cancel()  # a write still in flight when the stream ends: the stream is gone with it
            self._owner = None
            self._next_message = None
            self._resumed_ns = 0
            self._released.set()
            log.info("scheduler %s disconnected (stream %d)", peer, self._stream_epoch)

    async def _read_step(self, reader: ReadAhead[executor_pb2.StepRequest], context: grpc.aio.ServicerContext,
                         writing: asyncio.Future[None]) -> executor_pb2.StepRequest | None:
        """The stream's next step (None at its end); a message that does not parse ends the stream
        INVALID_ARGUMENT, after the result of the step before it is written."""
        try:
            return await next_step(reader)
        except DecodeError as e:
            log.warning("a StepRequest that does not parse (%s); ending the stream", e)
            await flushed(writing)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"StepRequest: the message does not parse ({e})")
            raise  # (abort raises)

    async def _answer(self, step: executor_pb2.StepRequest, context: grpc.aio.ServicerContext,
                      writing: asyncio.Future[None]) -> executor_pb2.StepResult:
        """Run one step of the stream; a stopping executor or a lost backend ends the stream UNAVAILABLE instead,
        after the last result written."""
        if self.stopping.is_set():  # the scheduler recomputes the requests (elsewhere, in a pool)
            log.info("step %d: shutting down; ending the stream unanswered", step.step_id)
            await writing
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the executor is shutting down")
        with self.activity.step():
            async with self._step_lock:
                try:
                    return await self.run_step(step)
                except BackendLost as e:  # fail-stop: the process is going down; the scheduler recomputes
                    log.error("step %d: backend lost (%s); ending the stream unanswered", step.step_id, e)
                    await writing
                    await context.abort(grpc.StatusCode.UNAVAILABLE, f"executor lost its backend: {e}")
                    raise  # (abort raises)

    async def _wait_for_release(self) -> bool:
        try:
            await asyncio.wait_for(self._released.wait(), HANDOVER_WAIT_S)
        except TimeoutError:
            return False
        return self._owner is None

    async def run_step(self, step: executor_pb2.StepRequest) -> executor_pb2.StepResult:
        """One step; the masks of a token_bitmasks_follow step are read from the open stream (_next_message)."""
        t0 = time.perf_counter_ns()
        follow = self._next_message
        result = executor_pb2.StepResult(step_id=step.step_id)
        for rid in step.finished_ids:
            self.table.drop(rid)
        try:
            masks = step_masks(step, self.backend.info.vocab_size)
            plan, running = self.validator.check(step)
        except StepRefused as e:
            if step.token_bitmasks_follow and follow is not None:
                with contextlib.suppress(StopAsyncIteration):
                    await follow()  # the masks that follow belong to this refused step
            result.error = str(e)
            return result
        self.table.commit(plan)
        for rid, message in plan.refused.items():
            result.errors.append(executor_pb2.RequestError(request_id=rid, message=message))
        try:
            self.backend.swap_out(block_maps(step.swap_out))
            self.backend.swap_in(block_maps(step.swap_in))
            self.backend.copy(block_maps(step.copy))
            t_swap = time.perf_counter_ns()
            states = self.table.states
            items = [self.table.item(states[a.request_id], a.num_tokens, a.draft_token_ids, a.num_model_drafts)
                     for a in plan.admitted]
            if masks:
                for item in items:
                    item.token_mask = masks.get(item.request_id) if item.sample else None
            t_prep = time.perf_counter_ns()
            if step.token_bitmasks_follow:
                outputs = await self._run_with_following_masks(step, items, follow)
            else:
                outputs = await self._run_passes(items, max(1, step.num_steps))
        except BackendLost:
            raise
        except (Exception, StopAsyncIteration) as e:  # a backend failure (CUDA OOM, a bug, ...) fails this step only
            log.exception("step %d failed", step.step_id)
            for request_id in {*(n.request_id for n in step.new_requests), *(r.request_id for r in running)}:
                self.table.drop(request_id)
            return executor_pb2.StepResult(step_id=step.step_id, error=str(e))
        t_fwd = time.perf_counter_ns()
        for admitted in plan.admitted:
            self.table.release_out_of_window(admitted.request_id)
        _fill_sampled(result, outputs)
        _fill_prompt_logprobs(result, items)
        result.timings.swap_ns = t_swap - t0
        result.timings.prepare_ns = t_prep - t_swap
        result.timings.forward_ns = t_fwd - t_prep
        result.timings.total_ns = time.perf_counter_ns() - t0
        if self.step_log is not None:
            passes = max(map(len, outputs.values()), default=1)
            self.step_log = append_line(self.step_log, step_record(items, passes, result.timings, t0,
                                                                   self._resumed_ns))
        return result

    async def _run_passes(self, items: list[BatchItem], num_steps: int) -> dict[str, list[SampleOutput]]:
        outputs: dict[str, list[SampleOutput]] = {}
        table = self.table
        states = table.states
        for remaining in range(num_steps - 1, -1, -1):
            if not items:
                break
            samples = await self.backend.execute_async(items)
            next_items: list[BatchItem] = []
            for item, sample in zip(items, samples, strict=True):
                state = states[item.request_id]
                state.num_computed = item.start + item.num_tokens
                if sample is None:
                    continue
                run = sample.run()
                drafts = len(item.draft_token_ids) + item.num_model_drafts
                if len(run) > drafts + 1:
                    raise RuntimeError(f"backend answered {len(run)} tokens for {drafts} drafts")
                state.num_computed += len(run) - 1  # the accepted drafts' KV is in the cache
                if item.num_model_drafts:  # the draft model was fed up to the last token and all drafts but one
                    fed = item.start + item.num_tokens + item.num_model_drafts - 1
                    state.draft_computed = min(state.num_computed, fed)
                state.token_ids.extend(s.token_id for s in run)
                outputs.setdefault(item.request_id, []).extend(run)
                if remaining and not item.draft_token_ids and self._fits_one_more(state):
                    next_items.append(table.item(state, 1))
            items = next_items
        return outputs

    async def _run_with_following_masks(self, step: executor_pb2.StepRequest, items: list[BatchItem],
                                        follow: Callable[[], Awaitable[executor_pb2.StepRequest]] | None
                                        ) -> dict[str, list[SampleOutput]]:
        """A step whose masks come in the next message: a backend that overlaps them runs the forward pass while
        they travel (its sampler waits for them), another one waits for them first. Bad masks fail the step."""
        if follow is None:
            raise StepRefused("token_bitmasks_follow without a stream to read the masks from")
        deferred = DeferredMasks()
        reader = asyncio.ensure_future(self._read_masks(step, follow, deferred))
        try:
            if getattr(self.backend, "overlaps_token_masks", False):
                for item in items:
                    item.deferred_masks = deferred if item.sample else None
            else:
                await asyncio.shield(reader)
                masks = deferred.wait()
                for item in items:
                    item.token_mask = masks.get(item.request_id) if item.sample else None
            outputs = await self._run_passes(items, 1)
            await reader
            return outputs
        finally:
            deferred.fail(StepRefused("the step's token masks never came"))
            reader.cancel()
            if reader.done() and not reader.cancelled():
                reader.exception()  # retrieved: the step's error already says what went wrong

    async def _read_masks(self, step: executor_pb2.StepRequest,
                          follow: Callable[[], Awaitable[executor_pb2.StepRequest]], deferred: DeferredMasks) -> None:
        try:
            deferred.set(follow_masks(step, await follow(), self.backend.info.vocab_size))
        except StopAsyncIteration:
            deferred.fail(StepRefused("the stream ended before the step's token masks"))
            raise
        except StepRefused as e:
            deferred.fail(e)
            raise

    def _fits_one_more(self, state: RequestState) -> bool:
        """Whether a multi-step pass may go on with one more token of this request: its block table holds
        the next position, and the token it samples stays within max_model_len."""
        t = self.table
        if t.max_model_len and len(state.token_ids) >= t.max_model_len:
            return False
        try:
            check_span(state.num_computed, 1, len(state.block_table or ()), t.block_size, t.max_model_len)
            if state.windows:
                check_span(state.num_computed, 1, t.window_blocks_covered(state, state.num_computed + 1),
                           t.block_size, t.max_model_len)
        except RequestRefused:
            return False
        return True


def block_maps(mappings: Iterable[executor_pb2.BlockMapping]) -> BlockMap:
    return [(m.src, m.dst) for m in mappings]


def _token_logprobs(s: SampleOutput) -> common_pb2.TokenLogprobs:
    top = [common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs]
    return common_pb2.TokenLogprobs(token_id=s.token_id, logprob=s.logprob or 0.0, top=top)


def append_line(log_file: TextIO, line: str) -> TextIO | None:
    """The file, after appending the line; None (the log is off) when the write fails (a full disk), which must not
    fail the step."""
    try:
        log_file.write(line + "\n")
    except (OSError, ValueError) as e:
        log.warning("step log off: %s", e)
        return None
    return log_file


async def next_step(reader: ReadAhead[executor_pb2.StepRequest]) -> executor_pb2.StepRequest | None:
    """The stream's next step; None at its end."""
    try:
        return await reader.next()
    except StopAsyncIteration:
        return None


async def flushed(writing: asyncio.Future[None]) -> None:
    """Wait for the write in flight to end; its failure (the stream already gone) is the caller's to ignore."""
    with contextlib.suppress(Exception):
        await writing


def done_writing() -> asyncio.Future[None]:
    """A finished write: the stream's first step has no result before it to wait for."""
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    future.set_result(None)
    return future


def step_record(items: list[BatchItem], passes: int, timings: executor_pb2.StepTimings, start_ns: int = 0,
                resumed_ns: int = 0) -> str:
    """One step as a JSON line: its first pass's work (attended = the keys its queries attend to, causally;
    context = the keys its sequences hold), the passes it ran (multi-step), its timings, when it started and
    when the stream got control back after the step before it was answered (start_ns, resumed_ns: the process's
    perf_counter_ns; the gap between two steps is the executor's idle time, #29: resumed_ns - the last step's end
    writes its result, start_ns - resumed_ns waits for and reads this step's message)."""
    return json.dumps({
        "seqs": len(items), "tokens": sum(i.num_tokens + len(i.draft_token_ids) for i in items),
        "drafts": sum(len(i.draft_token_ids) for i in items), "sampled": sum(i.sample for i in items),
        "attended": sum(attended_keys(i.start, i.num_tokens) for i in items),
        "context": sum(i.start + i.num_tokens for i in items), "passes": passes,
        "forward_ns": timings.forward_ns, "total_ns": timings.total_ns, "start_ns": start_ns,
        "resumed_ns": resumed_ns})


def _fill_sampled(result: executor_pb2.StepResult, outputs: dict[str, list[SampleOutput]]) -> None:
    """SampledTokens as three column extends; logprobs for the requests that asked for them."""
    columns = outputs.values()
    sampled = result.sampled
    sampled.request_ids.extend(outputs)
    sampled.num_tokens.extend(map(len, columns))
    sampled.token_ids.extend([s.token_id for samples in columns for s in samples])
    for rid, samples in outputs.items():
        if samples[0].logprob is not None:
            result.logprobs.add(request_id=rid, tokens=[_token_logprobs(s) for s in samples])


def _fill_prompt_logprobs(result: executor_pb2.StepResult, items: list[BatchItem]) -> None:
    """The prompt logprobs the step's (first) pass answered, for the requests that asked."""
    for item in items:
        out = item.prompt_out
        if out is not None:
            result.prompt_logprobs.add(request_id=item.request_id, first_position=out.first_position,
                                       tokens=[_token_logprobs(s) for s in out.tokens])


@dataclass(slots=True)
class Serving:
    """A started Executor server; attach() gives it its backend when that has loaded."""

    server: grpc.aio.Server
    port: int
    servicer: ExecutorServicer
    health: health.aio.HealthServicer

    async def attach(self, backend: Backend) -> None:
        self.servicer.attach(backend)
        for name in ("", EXECUTOR_SERVICE):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)


async def serve(backend: Backend, listen: str, credentials: grpc.ServerCredentials | None = None,
                secret: str | None = None, stopping: asyncio.Event | None = None,
                step_log: TextIO | None = None, limits: StepLimits | None = None) -> tuple[grpc.aio.Server, int]:
    """Start the Executor API over a loaded backend (start_serving, then attach)."""
    serving = await start_serving(listen, credentials, secret, stopping, step_log, limits)
    await serving.attach(backend)
    return serving.server, serving.port


async def start_serving(listen: str, credentials: grpc.ServerCredentials | None = None,
                        secret: str | None = None, stopping: asyncio.Event | None = None,
                        step_log: TextIO | None = None, limits: StepLimits | None = None) -> Serving:
    """Start the Executor API before its backend has loaded: health says NOT_SERVING and calls wait until
    Serving.attach(). Once `stopping` is set, an open Execute stream ends UNAVAILABLE at its next step instead of
    serving on through the shutdown's grace period. `limits`: what one step may carry."""
    interceptors = [SecretInterceptor(secret)] if secret else []
    server = grpc.aio.server(options=EXECUTOR_LINK_OPTIONS, interceptors=interceptors)
    servicer = ExecutorServicer(None, stopping, step_log, limits)
    executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((EXECUTOR_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    for name in ("", EXECUTOR_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = add_port(server, listen, credentials)
    await server.start()
    return Serving(server, port, servicer, health_servicer)
