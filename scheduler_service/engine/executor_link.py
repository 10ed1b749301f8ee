"""The scheduler's side of the Executor contract: one bidirectional stream, one message each way a step."""

from __future__ import annotations

import asyncio

import grpc

from protos.contract import split_columns
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import EXECUTOR_LINK_OPTIONS, EXECUTOR_SECRET_METADATA_KEY, open_channel
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import ExecutorResult, ScheduledWork, SchedulerOutput
from scheduler_service.core.request import SamplingOptions

LOST_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE,
               grpc.ChannelConnectivity.SHUTDOWN)


class ExecutorLost(Exception):
    """The stream broke: the executor's KV cache and request state are gone."""


class MalformedResult(ValueError):
    """A step result that breaks the contract (its sampled-token columns disagree): the executor is not trusted
    with the step's requests any more."""


def sampling_proto(s: SamplingOptions) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=s.min_p, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, priority=s.priority, logit_bias=dict(s.logit_bias))
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    return msg


def step_proto(out: SchedulerOutput) -> executor_pb2.StepRequest:
    step = executor_pb2.StepRequest(
        step_id=out.step_id, finished_ids=out.finished_ids, swapped_out_ids=out.swapped_out_ids,
        swap_out=[executor_pb2.BlockMapping(src=a, dst=b) for a, b in out.swap_out],
        swap_in=[executor_pb2.BlockMapping(src=a, dst=b) for a, b in out.swap_in],
        copy=[executor_pb2.BlockMapping(src=a, dst=b) for a, b in out.copy],
        num_steps=out.num_steps, num_lookahead_slots=out.num_lookahead_slots)
    ids: list[str] = []
    num_tokens: list[int] = []
    num_blocks: list[int] = []
    blocks: list[int] = []
    resumed: list[bool] = []
    drafted: list[ScheduledWork] = []
    for w in out.scheduled:
        if w.is_new:
            _add_new(step, w)
            continue
        ids.append(w.request.request_id)
        num_tokens.append(w.num_tokens)
        num_blocks.append(len(w.new_block_ids))
        blocks += w.new_block_ids
        resumed.append(w.resumed)
        if w.num_drafts:
            drafted.append(w)
    running = step.running
    running.request_ids.extend(ids)
    running.num_scheduled_tokens.extend(num_tokens)
    running.num_new_blocks.extend(num_blocks)
    running.new_block_ids.extend(blocks)
    if any(resumed):
        running.resumed.extend(resumed)
    if drafted:
        _add_drafts(running, out)
    if out.window:
        _add_window_blocks(step, out)
    return step


def _add_window_blocks(step: executor_pb2.StepRequest, out: SchedulerOutput) -> None:
    """A hybrid model's window-group tables: whole for new requests, the columns of the running ones."""
    window = out.window
    for new in step.new_requests:
        blocks = window.get(new.request_id)
        if blocks is not None:
            new.window_block_ids.extend(blocks.flat())
            new.window_block_start = blocks.start
    running = step.running
    for w in out.scheduled:
        if w.is_new:
            continue
        blocks = window.get(w.request.request_id)
        running.num_new_window_blocks.append(blocks.length if blocks is not None else 0)
        running.window_block_start.append(blocks.start if blocks is not None and w.resumed else 0)
        if blocks is not None:
            running.new_window_block_ids.extend(blocks.flat())


def _add_drafts(running: executor_pb2.RunningRequests, out: SchedulerOutput) -> None:
    """The draft columns, aligned with the running requests (speculative decoding)."""
    works = [w for w in out.scheduled if not w.is_new]
    if any(w.draft_token_ids for w in works):
        for w in works:
            running.num_draft_tokens.append(len(w.draft_token_ids))
            running.draft_token_ids.extend(w.draft_token_ids)
    if any(w.num_model_drafts for w in works):
        running.num_model_draft_tokens.extend(w.num_model_drafts for w in works)


def _add_new(step: executor_pb2.StepRequest, w: ScheduledWork) -> None:
    r = w.request
    sampling = sampling_proto(r.sampling)
    if r.wants_prompt_logprobs and r.sampling.prompt_logprobs is not None:  # not once delivered (a recompute)
        sampling.prompt_logprobs = r.sampling.prompt_logprobs
    step.new_requests.add(
        request_id=r.request_id, token_ids=r.all_token_ids, num_prompt_tokens=r.num_prompt_tokens,
        num_computed_tokens=r.num_computed_tokens, num_scheduled_tokens=w.num_tokens, block_ids=w.new_block_ids,
        sampling=sampling)


def result_from_proto(msg: executor_pb2.StepResult, out: SchedulerOutput) -> ExecutorResult:
    result = ExecutorResult(busy_s=msg.timings.total_ns / 1e9)
    if msg.error:
        result.errors = {w.request.request_id: f"executor refused the step: {msg.error}" for w in out.scheduled}
        return result
    s = msg.sampled
    ids, tokens, counts = list(s.request_ids), list(s.token_ids), list(s.num_tokens)
    if len(ids) != len(counts) or sum(counts) != len(tokens):
        raise MalformedResult(f"step {msg.step_id}: sampled tokens of {len(ids)} requests with {len(counts)} counts"
                              f" adding up to {sum(counts)}, but {len(tokens)} tokens")
    if counts.count(1) == len(counts):  # one token each: the columns are the answer
        result.ids, result.tokens = ids, tokens
    else:
        result.sampled = dict(zip(ids, split_columns(tokens, counts), strict=True))
    for lp in msg.logprobs:
        result.logprobs[lp.request_id] = [token_logprob(t) for t in lp.tokens]
    for p in msg.prompt_logprobs:  # checked against the request's positions by the core (core/prompt_logprobs.py)
        result.prompt_logprobs[p.request_id] = (p.first_position, [token_logprob(t) for t in p.tokens])
    result.errors = {e.request_id: e.message for e in msg.errors}
    return result


def token_logprob(msg: common_pb2.TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, tuple((t.token_id, t.logprob) for t in msg.top))


class ExecutorConnection:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None,
                 step_timeout: float | None = None, secret: str | None = None) -> None:
        self.address = address
        self.step_timeout = step_timeout
        self._channel = open_channel(address, credentials, EXECUTOR_LINK_OPTIONS)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._metadata = ((EXECUTOR_SECRET_METADATA_KEY, secret),) if secret else None
        self._call: grpc.aio.StreamStreamCall | None = None
        self.busy_ns = 0  # the executor's own time in run_step (StepResult.timings.total_ns), summed
        self._lost = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None

    async def describe(self, timeout: float = 5.0) -> executor_pb2.DescribeResponse:
        describe = await self._stub.Describe(executor_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True,
                                             metadata=self._metadata)
        self._lost.clear()
        return describe

    async def execute(self, out: SchedulerOutput) -> ExecutorResult:
        """One step; ExecutorLost for every way the stream can fail (an error status, a refused stream,
        a call already finished, a closed stream, no answer in time)."""
        await self.send(out)
        return await self.receive(out)

    async def send(self, out: SchedulerOutput, masks: executor_pb2.TokenBitmasks | None = None,
                   follow: bool = False) -> None:
        """Write a step (with the token masks of its constrained requests, or with follow: they come in the next
        message, send_masks); with async scheduling the next one is written before this one's result is read."""
        step = step_proto(out)
        if masks is not None:
            step.token_bitmasks.CopyFrom(masks)
        step.token_bitmasks_follow = follow
        await self._write(step)

    async def send_masks(self, step_id: int, masks: executor_pb2.TokenBitmasks) -> None:
        """The masks of a step sent with follow."""
        await self._write(executor_pb2.StepRequest(step_id=step_id, token_bitmasks=masks))

    async def _write(self, step: executor_pb2.StepRequest) -> None:
        try:
            if self._call is None:
                self._call = self._stub.Execute(metadata=self._metadata)
            await self._call.write(step)
        except (asyncio.InvalidStateError, grpc.aio.UsageError, grpc.RpcError) as e:
            raise await self._stream_failed(e) from e

    async def _stream_failed(self, e: BaseException) -> ExecutorLost:
        """Every way the step stream can fail, as one ExecutorLost (the stream is dropped)."""
        if isinstance(e, grpc.aio.AioRpcError):
            self.drop_stream()
            return ExecutorLost(f"{e.code().name}: {e.details()}")
        status = await self._status()
        self.drop_stream()
        return ExecutorLost(f"the step stream ended ({status or type(e).__name__}: {e})")

    async def receive(self, out: SchedulerOutput) -> ExecutorResult:
        """The result of step `out`: steps are answered in the order they were written."""
        if self._call is None:
            raise ExecutorLost("executor stream closed")
        try:
            msg = await asyncio.wait_for(self._call.read(), self.step_timeout)
        except TimeoutError as e:
            self.drop_stream()
            raise ExecutorLost(f"no answer to step {out.step_id} within {self.step_timeout}s") from e
        except (asyncio.InvalidStateError, grpc.aio.UsageError, grpc.RpcError) as e:
            raise await self._stream_failed(e) from e
        if msg is grpc.aio.EOF or msg.step_id != out.step_id:
            status = await self._status()
            self.drop_stream()
            raise ExecutorLost(f"executor closed the step stream{f' ({status})' if status else ''}")
        self.busy_ns += msg.timings.total_ns
        try:
            return result_from_proto(msg, out)
        except MalformedResult as e:
            self.drop_stream()
            raise ExecutorLost(f"executor broke the step contract: {e}") from e

    async def _status(self) -> str:
        """The finished stream's status and message, for the log; empty if it has not finished."""
        call = self._call
        if call is None or not call.done():
            return ""
        try:
            return f"{(await call.code()).name}: {await call.details()}"
        except (asyncio.CancelledError, grpc.RpcError):
            return ""

    async def wait_until_lost(self) -> None:
        """Return once a connection that was up has gone down (the executor died, restarted, or stopped
        answering keepalive pings). One watcher task per connection, not one per wait: watches started
        and cancelled at every idle moment leaked memory inside grpc."""
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch(), name="executor-watch")
        await self._lost.wait()

    async def _watch(self) -> None:
        state = self._channel.get_state(try_to_connect=False)
        while True:
            if state in LOST_STATES:
                self._lost.set()
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=False)

    def drop_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.drop_stream()
        if self._watcher is not None:
            self._watcher.cancel()
        await self._channel.close()
