"""The scheduler's side of the Executor contract: one bidirectional stream, one message each way a step."""

from __future__ import annotations

import grpc

from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from protos.wire import open_channel
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import SamplingOptions

LOST_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.IDLE,
               grpc.ChannelConnectivity.SHUTDOWN)


class ExecutorLost(Exception):
    """The stream broke: the executor's KV cache and request state are gone."""


def sampling_proto(s: SamplingOptions) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=s.min_p, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, priority=s.priority)
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
    for n in out.new_requests():
        step.new_requests.append(executor_pb2.NewRequest(
            request_id=n.request_id, token_ids=n.token_ids, num_prompt_tokens=n.num_prompt_tokens,
            num_computed_tokens=n.num_computed_tokens, num_scheduled_tokens=n.num_scheduled_tokens,
            block_ids=n.block_ids, sampling=sampling_proto(n.sampling)))
    for r in out.running_requests():
        step.running_requests.append(executor_pb2.RunningRequest(
            request_id=r.request_id, new_block_ids=r.new_block_ids,
            num_scheduled_tokens=r.num_scheduled_tokens, resumed=r.resumed))
    return step


def result_from_proto(msg: executor_pb2.StepResult, out: SchedulerOutput) -> ExecutorResult:
    result = ExecutorResult()
    if msg.error:
        result.errors = {w.request.request_id: f"executor refused the step: {msg.error}" for w in out.scheduled}
        return result
    for o in msg.outputs:
        result.sampled[o.request_id] = list(o.token_ids)
        if o.logprobs:
            result.logprobs[o.request_id] = list(o.logprobs)
    result.errors = {e.request_id: e.message for e in msg.errors}
    return result


class ExecutorConnection:
    def __init__(self, address: str, credentials: grpc.ChannelCredentials | None = None) -> None:
        self.address = address
        self._channel = open_channel(address, credentials)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._call: grpc.aio.StreamStreamCall | None = None

    async def describe(self, timeout: float = 5.0) -> executor_pb2.DescribeResponse:
        return await self._stub.Describe(executor_pb2.DescribeRequest(), timeout=timeout, wait_for_ready=True)

    async def execute(self, out: SchedulerOutput) -> ExecutorResult:
        try:
            if self._call is None:
                self._call = self._stub.Execute()
            await self._call.write(step_proto(out))
            msg = await self._call.read()
        except grpc.aio.AioRpcError as e:
            self._call = None
            raise ExecutorLost(f"{e.code().name}: {e.details()}") from e
        if msg is grpc.aio.EOF or msg.step_id != out.step_id:
            self._call = None
            raise ExecutorLost("executor closed the step stream")
        return result_from_proto(msg, out)

    async def wait_until_lost(self) -> None:
        """Return once a connection that was up has gone down (the executor died or restarted)."""
        state = self._channel.get_state(try_to_connect=False)
        while state not in LOST_STATES:
            await self._channel.wait_for_state_change(state)
            state = self._channel.get_state(try_to_connect=False)

    def drop_stream(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None

    async def close(self) -> None:
        self.drop_stream()
        await self._channel.close()
