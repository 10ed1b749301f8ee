"""The public Generate call, transport-neutral: validate, tokenize, queue, stream deltas back (gRPC and the OpenAI
HTTP API are adapters over GenerationServicer.generate)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import grpc

from protos.pagedserve.v1 import common_pb2, executor_pb2, generation_pb2, generation_pb2_grpc
from protos.wire import DEFAULT_MAX_REQUEST_BYTES
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import RequestDelta
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.frontend.auth import ANONYMOUS, Caller, TenantScope, presented_key
from scheduler_service.frontend.constraints import FIELD, GrammarCheck, constraint_from
from scheduler_service.frontend.resume import ResumePoint, resume_point, resumed_requests
from scheduler_service.frontend.stop_strings import StopMatcher
from scheduler_service.frontend.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer, TokenStream, encode_off_loop
from scheduler_service.frontend.validation import (
    InvalidArgument,
    MalformedRequest,
    RequestLimits,
    max_prompt_bytes,
    sampling_options,
    validate_prompt,
)
from scheduler_service.messages import QueueFull, RefusalCounter

log = logging.getLogger("pagedserve.scheduler")
FINISH_REASONS = {
    FinishReason.STOPPED: generation_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: generation_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORTED: generation_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: generation_pb2.FINISH_REASON_ERROR,
}
API_SERVER_HEADER = "pagedserve-api-server"  # "INDEX PID" of the api server process serving the call


@dataclass(slots=True)
class SequenceOutput:
    """One sequence's text as it streams: detokenized, cut at stop strings, the stop token's text left out."""

    index: int
    detokenizer: TokenStream
    stops: StopMatcher
    min_tokens: int = 0
    eos_token_ids: frozenset[int] = frozenset()  # the model's EOS ids; empty with ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False  # include_stop_str_in_output: the stop string or stop token stays in the text
    num_tokens: int = 0
    done: bool = False

    def ends_on_stop_token(self, token_ids: list[int], reason: FinishReason | None) -> bool:
        """Whether the core ended the sequence on its last token being EOS or a stop token (STOPPED past
        min_tokens: the core's only other STOPPED finishes are the stop strings this front-end reports)."""
        return (reason is FinishReason.STOPPED and bool(token_ids)
                and self.num_tokens + len(token_ids) >= self.min_tokens
                and (token_ids[-1] in self.eos_token_ids or token_ids[-1] in self.stop_token_ids))

    def read(self, token_ids: list[int], stop_token: bool = False) -> tuple[str, int | None]:
        """Text to emit for new tokens, and how many of them to keep when a stop string ends the sequence.

        Stop strings count only once min_tokens are out (as in vLLM); the tokens after the one that
        completed a stop string are dropped, like the text after it. When the last token is the stop token
        that ended the sequence (stop_token), its text is left out unless include_stop; it still counts."""
        if stop_token and not self.include_stop:
            text, keep = self._read(token_ids[:-1])
            if keep is None:
                self.num_tokens += 1
            return text, keep
        return self._read(token_ids)

    def _read(self, token_ids: list[int]) -> tuple[str, int | None]:
        if not self.stops.active:
            self.num_tokens += len(token_ids)
            return self.detokenizer.step(token_ids), None
        text = ""
        for i, token in enumerate(token_ids):
            self.num_tokens += 1
            piece = self.detokenizer.step([token])
            if self.num_tokens < self.min_tokens:
                text += self.stops.feed_unchecked(piece)
                continue
            emitted, stopped = self.stops.feed(piece)
            text += emitted
            if stopped:
                return text, i + 1
        return text, None


class RequestError(Exception):
    """A Generate call refused or ended with a status: what any transport (gRPC, HTTP) turns into its own."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class WriteWatch:
    """Cancels the task that made it once one of its writes has waited `timeout` seconds: the task sets `since` to
    the loop's time before each write and to None after it, and a timer checks at most once every `timeout`
    seconds (a timer per write cost 4.5 us a response with asyncio.timeout, 12 us with wait_for)."""

    __slots__ = ("handle", "loop", "since", "task", "timeout")

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None  # (always: called from a coroutine)
        self.task = task
        self.timeout = timeout
        self.since: float | None = None
        self.handle = self.loop.call_later(timeout, self._check)

    def _check(self) -> None:
        waited = 0.0 if self.since is None else self.loop.time() - self.since
        if waited >= self.timeout:
            log.info("a Generate call ended: its client read no response for --grpc-write-timeout %gs (its request "
                     "aborted)", self.timeout)
            self.task.cancel()
            return
        self.handle = self.loop.call_later(self.timeout - waited, self._check)

    def close(self) -> None:
        self.handle.cancel()


@dataclass(slots=True)
class ServingLimits:
    """Bounds on what the public API admits (docs/operations.md, "Limits")."""

    max_open_calls: int = 10_000
    executor_wait_timeout: float = 30.0
    write_timeout: float = 30.0  # --grpc-write-timeout
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class StreamHandle(Protocol):
    """What add() returns: the engine's record of one sequence (RequestStream, or an api server's)."""

    executor_unavailable: bool
    invalid_argument: bool


class EngineHandle(Protocol):
    """What the public API needs of the engine core: the in-process ExecutorPool, or an api server's CoreClient."""

    describe: executor_pb2.DescribeResponse | None
    ready: asyncio.Event
    metrics_model_name: str | None
    on_ready_change: Callable[[bool], object] | None

    def add(self, request: Request, queue: asyncio.Queue[Any], stop_strings: bool = False) -> StreamHandle:
        """stop_strings: this front-end matches stop strings for the request, so it settles a LENGTH finish
        with finish() (as `stop` when the last allowed token completed one)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def finish(self, request_id: str, reason: FinishReason, error: str = "") -> None: ...

    def abort_all(self, message: str) -> int:
        """End every open request (shutdown after the drain timeout); how many there were."""
        ...

    def idle(self) -> bool: ...

    async def wait_idle(self) -> None: ...


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, engine: EngineHandle, max_logprobs: int, tokenizer_dir: str | None = None,
                 serving: ServingLimits | None = None) -> None:
        self.engine = engine
        self.max_logprobs = max_logprobs
        self.serving = serving or ServingLimits()
        self.shutting_down = False
        self.server_index: int | None = None
        # with API keys: each key's request ids are its own, and its requests have a prefix cache of their own
        # unless share_prefix_cache (None: no keys, one namespace and one cache for all callers)
        self.keys: TenantScope | None = None
        self.share_prefix_cache = False
        self.open_calls = 0
        self.refusals = RefusalCounter(lambda: engine.metrics_model_name or
                                       (engine.describe.model_id if engine.describe else ""))
        self._tokenizer: TextTokenizer | None = None
        self._tokenizer_key: tuple[str, int, bool] | None = None
        self._fixed_tokenizer = (HFTokenizer((Path(tokenizer_dir) / "tokenizer.json").read_text())
                                 if tokenizer_dir else None)
        self._encode_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._grammar_check = GrammarCheck()

    def tokenizer(self) -> TextTokenizer:
        """--tokenizer's if given, else the one the connected executor ships (rebuilt if it changes)."""
        if self._fixed_tokenizer is not None:
            return self._fixed_tokenizer
        d = self.engine.describe
        key = (d.tokenizer_json, d.bos_token_id, d.add_bos_token) if d is not None else None
        if self._tokenizer is None or key != self._tokenizer_key:
            if d is not None and d.tokenizer_json:
                self._tokenizer = HFTokenizer(d.tokenizer_json, d.bos_token_id if d.add_bos_token else None)
            else:
                self._tokenizer = ByteTokenizer()
            self._tokenizer_key = key
        return self._tokenizer

    def request_limits(self) -> RequestLimits:
        d = self.engine.describe
        if d is None:
            raise RuntimeError("no executor described yet")
        prompt_bytes = max_prompt_bytes(d.max_model_len, self.tokenizer().max_token_bytes,
                                        self.serving.max_request_bytes)
        cap = d.capabilities.max_logprobs  # the executor refuses more (0: not advertised)
        max_logprobs = min(self.max_logprobs, cap) if cap else self.max_logprobs
        return RequestLimits(vocab_size=d.vocab_size, max_model_len=d.max_model_len, max_logprobs=max_logprobs,
                             max_prompt_bytes=prompt_bytes, prompt_logprobs=d.capabilities.prompt_logprobs)

    def caller_of(self, key: str) -> Caller:
        """The caller presenting this API key: its request-id owner and its prefix-cache tenant."""
        if self.keys is None:
            return ANONYMOUS
        owner = self.keys.of(key)
        return Caller(owner, "" if self.share_prefix_cache else owner)

    async def Generate(self, request: generation_pb2.GenerateRequest | MalformedRequest,
                       context: grpc.aio.ServicerContext) -> None:
        """The gRPC call. A client that reads nothing for --grpc-write-timeout (gRPC's flow control holding a write)
        has its call cancelled: leaving generate() aborts its request, and the call no longer counts as open.
        Before, such a call stayed open for as long as its client held the connection, after --max-stream-buffer
        had aborted its request, and enough of them refused every new call (too many open calls)."""
        if self.server_index is not None:
            await context.send_initial_metadata(((API_SERVER_HEADER, f"{self.server_index} {os.getpid()}"),))
        caller = self.caller_of(presented_key(context.invocation_metadata()))
        watch = WriteWatch(self.serving.write_timeout)
        try:
            async with contextlib.aclosing(self.generate(request, caller)) as responses:  # type: ignore[type-var]
                async for response in responses:
                    watch.since = watch.loop.time()
                    await context.write(response)
                    watch.since = None
        except RequestError as e:
            await context.abort(e.code, e.message)
        finally:  # (cancelled by the watch, the call ends cancelled: no status can follow the held write)
            watch.close()

    async def generate(self, request: generation_pb2.GenerateRequest | MalformedRequest, caller: Caller = ANONYMOUS
                       ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        """The public Generate, transport-neutral: responses out, RequestError for a refusal or a failure. caller:
        who sent it (caller_of its API key)."""
        if isinstance(request, MalformedRequest):
            raise self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(request.error))
        if self.open_calls >= self.serving.max_open_calls:
            raise self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"too many open calls ({self.serving.max_open_calls}); retry later")
        self.open_calls += 1
        try:
            async for response in self._generate(request, caller):
                yield response
        finally:
            self.open_calls -= 1

    async def _generate(self, request: generation_pb2.GenerateRequest, caller: Caller
                        ) -> AsyncIterator[generation_pb2.GenerateResponse]:
        self._refuse_if_shutting_down()
        await self._wait_for_executor()
        self._refuse_if_shutting_down()
        try:
            rid, prompt_ids, by_index, point = await self._build(request, caller)
        except InvalidArgument as e:
            raise self.refuse(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        requests = list(by_index.values())
        queue: asyncio.Queue[RequestDelta | RequestError] = asyncio.Queue()
        streams: dict[str, StreamHandle] = {}
        stop_strings = any(request.sampling.stop)  # as StopMatcher.active
        try:
            for req in requests:
                streams[req.request_id] = self.engine.add(req, queue, stop_strings)
        except (QueueFull, ValueError) as e:
            for sub_id in streams:
                self.engine.abort(sub_id)
            if isinstance(e, QueueFull):
                raise self.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            raise self.refuse(grpc.StatusCode.ALREADY_EXISTS,
                              f"duplicate request_id {rid!r}: a call of yours with this id is still open") from None
        answered: set[str] = set()
        try:
            seqs = self._sequences(request, prompt_ids, by_index, point)
            async for response in self._stream(rid, prompt_ids, streams, seqs, queue, answered):
                yield response
        finally:
            for req in requests:
                if not req.is_finished or (stop_strings and req.request_id not in answered):
                    self.engine.abort(req.request_id)

    def refuse(self, code: grpc.StatusCode, message: str) -> RequestError:
        """Count and log (at INFO, at most once a second per status) a call ended with `code`."""
        self.refusals.add(code.name, message)
        return RequestError(code, message)

    def _refuse_if_shutting_down(self) -> None:
        if self.shutting_down:
            raise self.refuse(grpc.StatusCode.UNAVAILABLE, "server is shutting down")

    async def _wait_for_executor(self) -> None:
        if self.engine.ready.is_set():
            return
        timeout = self.serving.executor_wait_timeout
        try:
            await asyncio.wait_for(self.engine.ready.wait(), timeout)
        except TimeoutError:
            raise self.refuse(grpc.StatusCode.UNAVAILABLE,
                              f"no executor connected within --executor-wait-timeout {timeout}s; retry later"
                              ) from None

    async def _build(self, request: generation_pb2.GenerateRequest, caller: Caller = ANONYMOUS
                     ) -> tuple[str, list[int], dict[int, Request], ResumePoint | None]:
        """The call's id, prompt, requests by sequence index (those a resume point leaves to run), the point."""
        limits = self.request_limits()
        validate_prompt(request, limits)
        if request.prompt_token_ids:
            prompt_ids = list(request.prompt_token_ids)
        else:
            prompt_ids = await encode_off_loop(self.tokenizer(), request.prompt, self._encode_pool)
        sampling = sampling_options(request, limits, len(prompt_ids))
        constraint = constraint_from(request.sampling)
        if constraint is not None:
            self._check_constrainable(request.sampling)
            await self._grammar_check.check(constraint)
            sampling = replace(sampling, constraint=constraint)
        n = request.sampling.n if request.sampling.HasField("n") else 1
        point = resume_point(request, n, sampling.max_tokens, limits)
        rid = request.request_id or uuid.uuid4().hex
        hint = request.output_len_hint if request.HasField("output_len_hint") else None
        salt = request.cache_salt if request.HasField("cache_salt") else None
        now = time.monotonic()
        requests: list[Request] = []
        for i in range(n):
            sub = sampling if n == 1 or sampling.seed is None else replace(sampling, seed=(sampling.seed + i) % 2**64)
            if i and sub.prompt_logprobs is not None:  # one prompt, computed and answered once: by sequence 0
                sub = replace(sub, prompt_logprobs=None)
            sub_id = caller.scoped_id(rid if n == 1 else f"{rid}#{i}")
            requests.append(Request(sub_id, list(prompt_ids), sub, now, output_len_hint=hint,
                                    share_prompt_with=requests[0].request_id if requests else None,
                                    cache_salt=salt, tenant=caller.tenant, owner=caller.owner))
        return rid, prompt_ids, resumed_requests(requests, point), point

    def _check_constrainable(self, p: common_pb2.SamplingParams) -> None:
        d = self.engine.describe
        if d is None or not d.capabilities.token_bitmask:
            raise InvalidArgument(FIELD, "the executor does not apply token masks (Describe.capabilities."
                                         "token_bitmask), so this server cannot constrain outputs")
        if p.ignore_eos:
            raise InvalidArgument("sampling.ignore_eos", "cannot be set with structured_outputs (the grammar "
                                                         "decides where the output ends)")

    def _sequences(self, request: generation_pb2.GenerateRequest, prompt_ids: list[int],
                   by_index: dict[int, Request], point: ResumePoint | None) -> dict[str, SequenceOutput]:
        """Each sequence's output state; a resumed one's replays the tokens its client has (their text went out)."""
        tok = self.tokenizer()
        p = request.sampling
        stops = list(p.stop)
        include = p.include_stop_str_in_output
        describe = self.engine.describe
        eos = frozenset(describe.eos_token_ids if describe is not None and not p.ignore_eos else ())
        stop_ids = frozenset(p.stop_token_ids)
        seqs = {req.request_id: SequenceOutput(i, tok.stream(prompt_ids), StopMatcher(stops, include), p.min_tokens,
                                               eos, stop_ids, include)
                for i, req in by_index.items()}
        for i, req in by_index.items():
            if point is not None and point.tokens.get(i) and seqs[req.request_id].read(point.tokens[i])[1] is not None:
                raise self.refuse(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"resume: sequence {i} already ended at a stop string")
        return seqs

    async def _stream(self, rid: str, prompt_ids: list[int], streams: dict[str, StreamHandle],
                      seqs: dict[str, SequenceOutput], queue: asyncio.Queue[RequestDelta | RequestError],
                      answered: set[str]) -> AsyncIterator[generation_pb2.GenerateResponse]:
        remaining = len(seqs)
        while remaining:
            for delta in coalesce(self._checked([await queue.get(), *drain(queue)])):
                seq = seqs.get(delta.request_id)
                if seq is None or seq.done:
                    continue
                if delta.finish_reason is not None and streams[delta.request_id].executor_unavailable:
                    raise self.refuse(grpc.StatusCode.UNAVAILABLE, delta.error)
                if delta.finish_reason is not None and streams[delta.request_id].invalid_argument:
                    raise self.refuse(grpc.StatusCode.INVALID_ARGUMENT, delta.error)
                response = self._respond(delta, seq, rid, prompt_ids)
                if seq.done:
                    remaining -= 1
                    answered.add(delta.request_id)
                if response is not None:
                    yield response

    def _checked(self, items: list[RequestDelta | RequestError]) -> list[RequestDelta]:
        """The deltas; a refusal that came instead (from an engine core in another process) is raised."""
        for item in items:
            if isinstance(item, RequestError):
                raise self.refuse(item.code, item.message)
        return items  # type: ignore[return-value]

    def _respond(self, delta: RequestDelta, seq: SequenceOutput, rid: str, prompt_ids: list[int]
                 ) -> generation_pb2.GenerateResponse | None:
        token_ids, logprobs = delta.new_token_ids, delta.logprobs
        reason = delta.finish_reason
        stop_token = seq.ends_on_stop_token(token_ids, reason)
        text, keep = seq.read(token_ids, stop_token)
        if keep is not None:
            token_ids, logprobs = token_ids[:keep], logprobs[:keep]
            if reason in (None, FinishReason.LENGTH):
                reason = FinishReason.STOPPED
        elif reason is not None:
            text += seq.stops.feed_unchecked(seq.detokenizer.flush()) + seq.stops.flush()
        if reason is not None and delta.finish_reason in (None, FinishReason.LENGTH) and seq.stops.active:
            self.engine.finish(delta.request_id, reason)  # ends it in the core, or settles its LENGTH finish
        response = generation_pb2.GenerateResponse(request_id=rid, index=seq.index, token_ids=token_ids, text=text)
        if logprobs:
            response.logprobs.extend(token_logprobs_proto(lp) for lp in logprobs)
        if delta.prompt_logprobs is not None:
            response.prompt_logprobs.extend(token_logprobs_proto(lp) for lp in delta.prompt_logprobs)
            response.prompt_token_ids.extend(prompt_ids)
        if keep is not None:
            response.stop_str = seq.stops.matched or ""
        elif stop_token and token_ids[-1] not in seq.eos_token_ids:
            response.stop_token_id = token_ids[-1]
        if reason is not None:
            seq.done = True
            response.finish_reason = FINISH_REASONS[reason]
            response.error = delta.error
            response.usage.prompt_tokens = len(prompt_ids)
            response.usage.completion_tokens = seq.num_tokens
        if not (response.token_ids or response.text or seq.done or delta.prompt_logprobs is not None):
            return None
        return response


def token_logprobs_proto(lp: TokenLogprob) -> common_pb2.TokenLogprobs:
    top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return common_pb2.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=top)


def drain(queue: asyncio.Queue[RequestDelta | RequestError]) -> list[RequestDelta | RequestError]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def coalesce(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """One delta per request: when the stream falls behind the engine, it sends what piled up as one
    response instead of one per step."""
    if len(deltas) == 1:
        return deltas
    merged: dict[str, RequestDelta] = {}
    for d in deltas:
        into = merged.get(d.request_id)
        if into is None:
            merged[d.request_id] = RequestDelta(d.request_id, list(d.new_token_ids), d.finish_reason, d.error,
                                                list(d.logprobs), d.prompt_logprobs)
            continue
        into.new_token_ids += d.new_token_ids
        into.logprobs += d.logprobs
        if d.prompt_logprobs is not None:
            into.prompt_logprobs = d.prompt_logprobs
        into.finish_reason, into.error = d.finish_reason, d.error
    return list(merged.values())
