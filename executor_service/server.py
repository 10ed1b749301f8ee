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

from executor_service.backend import Backend, BatchItem, SampleOutput
from executor_service.simulated import SimulatedBackend
from executor_service.state import RequestTable, StepRefused
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import GRPC_OPTIONS, add_port

log = logging.getLogger("pagedserve.executor")
EXECUTOR_VERSION = "pagedserve-executor/0.1"


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        info = backend.info
        self.table = RequestTable(info.num_device_blocks, info.num_swap_blocks, info.block_size)
        self._inline = isinstance(backend, SimulatedBackend)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self._generation = 0
        self._step_lock = asyncio.Lock()

    async def Describe(self, request: executor_pb2.DescribeRequest,
                       context: grpc.aio.ServicerContext) -> executor_pb2.DescribeResponse:
        info = self.backend.info
        return executor_pb2.DescribeResponse(
            model_id=info.model_id, vocab_size=info.vocab_size, eos_token_ids=list(info.eos_token_ids),
            max_model_len=info.max_model_len, block_size=info.block_size,
            num_device_blocks=info.num_device_blocks, num_swap_blocks=info.num_swap_blocks,
            dtype=info.dtype, device=info.device, tokenizer_json=info.tokenizer_json,
            executor_version=EXECUTOR_VERSION, bos_token_id=info.bos_token_id or 0,
            add_bos_token=info.add_bos_token,
            capabilities=executor_pb2.Capabilities(
                swap=True, copy=True, chunked_prefill=True, max_num_steps=64,
                max_logprobs=info.max_logprobs, seeded_sampling=True))

    async def Execute(self, request_iterator: AsyncIterator[executor_pb2.StepRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[executor_pb2.StepResult]:
        async with self._step_lock:
            self._generation += 1
            generation = self._generation
            self.table.reset()
        log.info("scheduler connected (stream %d); request state cleared", generation)
        async for step in request_iterator:
            async with self._step_lock:
                if generation != self._generation:
                    result = executor_pb2.StepResult(step_id=step.step_id,
                                                     error="superseded by a newer scheduler stream")
                else:
                    result = await self.run_step(step)
            yield result
            if result.error.startswith("superseded"):
                return

    async def run_step(self, step: executor_pb2.StepRequest) -> executor_pb2.StepResult:
        t0 = time.perf_counter_ns()
        result = executor_pb2.StepResult(step_id=step.step_id)
        for rid in step.finished_ids:
            self.table.drop(rid)
        try:
            self.table.apply_swaps(step)
        except StepRefused as e:
            result.error = str(e)
            return result
        try:
            self.backend.swap_out([(m.src, m.dst) for m in step.swap_out])
            self.backend.swap_in([(m.src, m.dst) for m in step.swap_in])
            self.backend.copy([(m.src, m.dst) for m in step.copy])
            t_swap = time.perf_counter_ns()
            items = self._collect(step, result)
            t_prep = time.perf_counter_ns()
            outputs = await self._run_passes(items, max(1, step.num_steps))
        except ValueError as e:
            log.error("step %d refused: %s", step.step_id, e)
            for item_id in {*(n.request_id for n in step.new_requests), *(r.request_id for r in step.running_requests)}:
                self.table.drop(item_id)
            return executor_pb2.StepResult(step_id=step.step_id, error=str(e))
        t_fwd = time.perf_counter_ns()
        for rid, samples in outputs.items():
            result.outputs.append(_sampled(rid, samples))
        result.timings.swap_ns = t_swap - t0
        result.timings.prepare_ns = t_prep - t_swap
        result.timings.forward_ns = t_fwd - t_prep
        result.timings.total_ns = time.perf_counter_ns() - t0
        return result

    def _collect(self, step: executor_pb2.StepRequest, result: executor_pb2.StepResult) -> list[BatchItem]:
        items: list[BatchItem] = []
        for new in step.new_requests:
            error = self.table.add_new(new)
            self._add_item(new.request_id, new.num_scheduled_tokens, error, items, result)
        for run in step.running_requests:
            error = self.table.update_running(run)
            self._add_item(run.request_id, run.num_scheduled_tokens, error, items, result)
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
        for _ in range(num_steps):
            if not items:
                break
            samples = await self._forward(items)
            next_items: list[BatchItem] = []
            for item, sample in zip(items, samples, strict=True):
                state = self.table.states[item.request_id]
                state.num_computed = item.start + item.num_tokens
                if sample is None:
                    continue
                state.token_ids.append(sample.token_id)
                outputs.setdefault(item.request_id, []).append(sample)
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


def _sampled(rid: str, samples: list[SampleOutput]) -> executor_pb2.SampledTokens:
    msg = executor_pb2.SampledTokens(request_id=rid, token_ids=[s.token_id for s in samples])
    if any(s.logprob is not None for s in samples):
        msg.logprobs.extend(
            common_pb2.TokenLogprobs(
                token_id=s.token_id, logprob=s.logprob or 0.0,
                top=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in s.top_logprobs])
            for s in samples)
    return msg


async def serve(backend: Backend, listen: str, credentials: grpc.ServerCredentials | None = None
                ) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=GRPC_OPTIONS)
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
