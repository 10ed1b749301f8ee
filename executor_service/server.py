"""The Executor gRPC service: a thin shell around a backend and the request table."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from executor_service.auth import SecretInterceptor
from executor_service.backend import Backend, BatchItem, SampleOutput
from executor_service.simulated import SimulatedBackend
from executor_service.state import RequestTable, StepRefused
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import EXECUTOR_LINK_OPTIONS, add_port

log = logging.getLogger("pagedserve.executor")
EXECUTOR_VERSION = "pagedserve-executor/0.1"
MAX_NUM_STEPS = 64
HANDOVER_WAIT_S = 1.0  # how long a new stream waits for the previous one to end before it is refused


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        info = backend.info
        self.table = RequestTable(info.num_device_blocks, info.num_swap_blocks, info.block_size,
                                  info.vocab_size, info.max_model_len)
        self._inline = isinstance(backend, SimulatedBackend)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._generation = 0
        self._step_lock = asyncio.Lock()
        self._owner: str | None = None  # the peer whose Execute stream is open
        self._released = asyncio.Event()

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.DescribeResponse:
        info = self.backend.info
        return executor_pb2.DescribeResponse(
            model_id=info.model_id, vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
            max_model_len=info.max_model_len, block_size=info.block_size,
            num_device_blocks=info.num_device_blocks, num_swap_blocks=info.num_swap_blocks,
            dtype=info.dtype, device=info.device, tokenizer_json=info.tokenizer_json,
            executor_version=EXECUTOR_VERSION, bos_token_id=info.bos_token_id or 0,
            add_bos_token=info.add_bos_token, chat_template=info.chat_template,
            capabilities=executor_pb2.Capabilities(
                swap=True, copy=True, chunked_prefill=True, max_num_steps=MAX_NUM_STEPS,
                max_logprobs=info.max_logprobs, seeded_sampling=True))

    async def Execute(self, request_iterator: AsyncIterator[executor_pb2.StepRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[executor_pb2.StepResult]:
        """One scheduler at a time: a second stream is refused with FAILED_PRECONDITION while the first is
        open. A scheduler that dies or hangs loses its stream (closed connection, or keepalive pings
        unanswered), and then the next one is accepted."""
        peer = context.peer()
        if self._owner is not None and not await self._wait_for_release():
            log.warning("refused an Execute stream from %s: stream %d from %s is still open", peer,
                        self._generation, self._owner)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"this executor already serves a scheduler (stream from {self._owner}); one "
                                "scheduler at a time. It is released when that stream ends or stops answering "
                                "keepalive pings")
        self._owner = peer
        self._released.clear()
        try:
            async with self._step_lock:
                self._generation += 1
                self.table.reset()
            log.info("scheduler %s connected (stream %d); request state cleared", peer, self._generation)
            async for step in request_iterator:
                async with self._step_lock:
                    result = await self.run_step(step)
                yield result
        finally:
            self._owner = None
            self._released.set()
            log.info("scheduler %s disconnected (stream %d)", peer, self._generation)

    async def _wait_for_release(self) -> bool:
        try:
            await asyncio.wait_for(self._released.wait(), HANDOVER_WAIT_S)
        except TimeoutError:
            return False
        return self._owner is None

    async def run_step(self, step: executor_pb2.StepRequest) -> executor_pb2.StepResult:
        t0 = time.perf_counter_ns()
        result = executor_pb2.StepResult(step_id=step.step_id)
        for rid in step.finished_ids:
            self.table.drop(rid)
        try:
            if step.num_steps > MAX_NUM_STEPS:
                raise StepRefused(f"num_steps {step.num_steps} exceeds max_num_steps {MAX_NUM_STEPS} "
                                  "(Describe.capabilities)")
            running = running_columns(step.running)
            check_unique_ids(step, running)
            self.table.apply_swaps(step)
        except StepRefused as e:
            result.error = str(e)
            return result
        try:
            self.backend.swap_out([(m.src, m.dst) for m in step.swap_out])
            self.backend.swap_in([(m.src, m.dst) for m in step.swap_in])
            self.backend.copy([(m.src, m.dst) for m in step.copy])
            t_swap = time.perf_counter_ns()
            items = self._collect(step, running, result)
            t_prep = time.perf_counter_ns()
            outputs = await self._run_passes(items, max(1, step.num_steps))
        except Exception as e:  # a backend failure (bad input it caught, CUDA OOM, ...) fails this step only
            log.error("step %d failed: %s", step.step_id, e)
            for item_id in {*(n.request_id for n in step.new_requests), *step.running.request_ids}:
                self.table.drop(item_id)
            return executor_pb2.StepResult(step_id=step.step_id, error=str(e))
        t_fwd = time.perf_counter_ns()
        _fill_sampled(result, outputs)
        result.timings.swap_ns = t_swap - t0
        result.timings.prepare_ns = t_prep - t_swap
        result.timings.forward_ns = t_fwd - t_prep
        result.timings.total_ns = time.perf_counter_ns() - t0
        return result

    def _collect(self, step: executor_pb2.StepRequest, running: list[tuple[str, list[int], int, bool]],
                 result: executor_pb2.StepResult) -> list[BatchItem]:
        items: list[BatchItem] = []
        for new in step.new_requests:
            error = self.table.add_new(new)
            self._add_item(new.request_id, new.num_scheduled_tokens, error, items, result)
        for rid, new_blocks, n, resumed in running:
            self._add_item(rid, n, self.table.update_running(rid, new_blocks, n, resumed), items, result)
        return items

    def _add_item(self, rid: str, num_tokens: int, error: str, items: list[BatchItem],
                  result: executor_pb2.StepResult) -> None:
        if not error:
            item = self.table.item(self.table.states[rid], num_tokens)
            if isinstance(item, BatchItem):
                items.append(item)
                return
            error = item
        self.table.drop(rid)
        result.errors.append(executor_pb2.RequestError(request_id=rid, message=error))

    async def _run_passes(self, items: list[BatchItem], num_steps: int) -> dict[str, list[SampleOutput]]:
        outputs: dict[str, list[SampleOutput]] = {}
        states = self.table.states
        max_model_len = self.backend.info.max_model_len
        for remaining in range(num_steps - 1, -1, -1):
            if not items:
                break
            samples = await self._forward(items)
            next_items: list[BatchItem] = []
            for item, sample in zip(items, samples, strict=True):
                state = states[item.request_id]
                state.num_computed = item.start + item.num_tokens
                if sample is None:
                    continue
                state.token_ids.append(sample.token_id)
                outputs.setdefault(item.request_id, []).append(sample)
                if remaining and len(state.token_ids) < max_model_len:
                    follow = self.table.item(state, 1)
                    if isinstance(follow, BatchItem):
                        next_items.append(follow)
            items = next_items
        return outputs

    async def _forward(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        if self._inline:
            samples = self.backend.execute(items)
            delay = self.backend.delay_s(sum(i.num_tokens for i in items))  # type: ignore[attr-defined]
            if delay > 0:
                await asyncio.sleep(delay)
            return samples
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.backend.execute, items)


def check_unique_ids(step: executor_pb2.StepRequest, running: list[tuple[str, list[int], int, bool]]) -> None:
    ids = [n.request_id for n in step.new_requests] + [r[0] for r in running]
    if len(set(ids)) != len(ids):
        raise StepRefused("a request id appears more than once among new_requests and running")


def running_columns(run: executor_pb2.RunningRequests) -> list[tuple[str, list[int], int, bool]]:
    """(request id, its new blocks, tokens to compute, resumed) for each running request of a step."""
    ids, nums, counts = list(run.request_ids), list(run.num_scheduled_tokens), list(run.num_new_blocks)
    blocks, resumed = list(run.new_block_ids), list(run.resumed) or [False] * len(ids)
    if not len(ids) == len(nums) == len(counts) == len(resumed) or sum(counts) != len(blocks):
        raise StepRefused("running: request_ids, num_scheduled_tokens, num_new_blocks and resumed must be "
                          "columns of one length, and num_new_blocks must add up to len(new_block_ids)")
    if not any(counts):
        return [(rid, [], n, r) for rid, n, r in zip(ids, nums, resumed, strict=True)]
    out, offset = [], 0
    for rid, n, count, r in zip(ids, nums, counts, resumed, strict=True):
        out.append((rid, blocks[offset:offset + count], n, r))
        offset += count
    return out


def _token_logprobs(s: SampleOutput) -> common_pb2.TokenLogprobs:
    top = [common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs]
    return common_pb2.TokenLogprobs(token_id=s.token_id, logprob=s.logprob or 0.0, top=top)


def _fill_sampled(result: executor_pb2.StepResult, outputs: dict[str, list[SampleOutput]]) -> None:
    counts: list[int] = []
    tokens: list[int] = []
    for rid, samples in outputs.items():
        counts.append(len(samples))
        tokens += [s.token_id for s in samples]
        if samples[0].logprob is not None:
            result.logprobs.add(request_id=rid, tokens=[_token_logprobs(s) for s in samples])
    sampled = result.sampled
    sampled.request_ids.extend(outputs)
    sampled.num_tokens.extend(counts)
    sampled.token_ids.extend(tokens)


async def serve(backend: Backend, listen: str, credentials: grpc.ServerCredentials | None = None,
                secret: str | None = None) -> tuple[grpc.aio.Server, int]:
    interceptors = [SecretInterceptor(secret)] if secret else []
    server = grpc.aio.server(options=EXECUTOR_LINK_OPTIONS, interceptors=interceptors)
    executor_pb2_grpc.add_ExecutorServicer_to_server(ExecutorServicer(backend), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name, health.SERVICE_NAME,
             reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = add_port(server, listen, credentials)
    await server.start()
    for name in ("", names[0]):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port
