"""The OpenAI-compatible HTTP API on aiohttp: /v1/models, /v1/completions, /v1/chat/completions, /health.

A thin adapter over the transport-neutral GenerationServicer.generate: each prompt becomes one GenerateRequest,
its GenerateResponses become OpenAI choices or Server-Sent Events chunks, and a RequestError becomes an OpenAI
error object with the matching HTTP status. A client that disconnects cancels the handler, which closes the
generate() streams, which abort their requests and free their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError
from tokenizers import Tokenizer

from protos.pagedserve.v1 import generation_pb2
from scheduler_service.frontend.generation import GenerationServicer, RequestError
from scheduler_service.frontend.openai.chat import ChatTemplate
from scheduler_service.frontend.openai.connections import ConnectionGuard, GuardedSite, HttpLimits
from scheduler_service.frontend.openai.errors import ApiError, bad_param, from_status
from scheduler_service.frontend.openai.protocol import (
    ApiRequest,
    check_body,
    check_value_count,
    parse_chat,
    parse_completion,
    text_bytes,
)
from scheduler_service.frontend.openai.responses import (
    Choice,
    LogprobFormatter,
    PromptLogprobs,
    Usage,
    chat_choice,
    completion_choice,
    finish_reason,
    stop_reason,
)
from scheduler_service.frontend.openai.tool_answers import ToolAnswers
from scheduler_service.frontend.openai.tools import (
    ToolCallParser,
    ToolChoice,
    ToolRequest,
    tool_messages,
    tools_system_prompt,
)
from scheduler_service.frontend.tokenizer import INLINE_ENCODE_CHARS

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = ("/health", "/ping")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # stateless; built once, not per chunk


def dumps(data: Any) -> str:
    return COMPACT_JSON.encode(data)


@dataclass(slots=True, frozen=True)
class Endpoint:
    """What differs between /v1/completions and /v1/chat/completions."""

    id_prefix: str
    object: str
    chunk_object: str
    chat: bool


COMPLETIONS = Endpoint("cmpl", "text_completion", "text_completion", chat=False)
CHAT = Endpoint("chatcmpl", "chat.completion", "chat.completion.chunk", chat=True)


class OpenAIApi:
    def __init__(self, generation: GenerationServicer, served_model_name: str | None = None,
                 api_keys: list[str] | None = None, tokenizer_dir: str | None = None,
                 tool_parser: ToolCallParser = ToolCallParser.NONE) -> None:
        self.generation = generation
        self.tool_parser = tool_parser
        self.served_model_name = served_model_name
        self._keys = [k.encode() for k in api_keys or []]
        self._tokenizer_dir = tokenizer_dir
        self._chat_template: ChatTemplate | None = None
        self._chat_key: tuple[str, str] | None = None
        self.created = int(time.time())
        self._render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chat-template")

    def app(self, guard: ConnectionGuard | None = None) -> web.Application:
        """The application; with a guard, its middlewares time the body and track each connection's requests."""
        middlewares = [guard.track, self._errors, self._auth, self._json_only, guard.body_deadline] \
            if guard is not None else [self._errors, self._auth, self._json_only]
        app = web.Application(middlewares=middlewares, client_max_size=64 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body(), status=e.status)
        except RequestError as e:
            error = from_status(e.code, e.message)
            return web.json_response(error.body(), status=error.status)
        except web.HTTPRequestEntityTooLarge:
            error = ApiError(413, f"the request body is larger than {request.client_max_size} bytes")
            return web.json_response(error.body(), status=413)
        except web.HTTPException as e:
            error = ApiError(e.status, e.reason)
            return web.json_response(error.body(), status=e.status)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._keys and request.path not in OPEN_PATHS and not self._valid(presented_key(request)):
            raise ApiError(401, "missing or invalid API key (send the header 'Authorization: Bearer KEY')",
                           code="invalid_api_key")
        return await handler(request)

    @web.middleware
    async def _json_only(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every POST route takes application/json only (a charset parameter is fine), as vLLM: the content types a
        web page may POST cross-origin without a CORS preflight (text/plain, form encodings, none) get 415, so a
        page a user visits cannot drive a server that listens without an API key. No CORS header is ever sent."""
        if (request.method == "POST" and request.match_info.http_exception is None
                and request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower() != "application/json"):
            raise ApiError(415, "Unsupported Media Type: Only 'application/json' is allowed")
        return await handler(request)

    def _valid(self, key: str) -> bool:
        # a header's non-UTF-8 bytes arrive as surrogate escapes: compared as the bytes they were
        presented = key.encode("utf-8", "surrogateescape")
        return any(hmac.compare_digest(presented, k) for k in self._keys)

    def model_name(self) -> str | None:
        describe = self.generation.engine.describe
        return self.served_model_name or (describe.model_id if describe is not None else None)

    async def health(self, request: web.Request) -> web.Response:
        if self.generation.shutting_down or not self.generation.engine.ready.is_set():
            raise ApiError(503, "not ready: no executor connected, or shutting down")
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        name = self.model_name()
        data = [] if name is None else [{"id": name, "object": "model", "created": self.created,
                                         "owned_by": "pagedserve", "root": name, "parent": None,
                                         "max_model_len": self._max_model_len()}]
        return web.json_response({"object": "list", "data": data})

    def _max_model_len(self) -> int | None:
        describe = self.generation.engine.describe
        return describe.max_model_len if describe is not None else None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        api = parse_completion(await read_json(request), self._max_model_len())
        self._check_model(api.model)
        return await self._serve(request, api, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        api, messages, kwargs = parse_chat(await read_json(request), self.tool_parser)
        self._check_model(api.model)
        if api.tools is not None:
            messages, kwargs = self._with_tools(api.tools, messages, kwargs)
        api.prompts = [await self._chat_prompt(api, messages, kwargs)]
        return await self._serve(request, api, CHAT)

    def _with_tools(self, tools: ToolRequest, messages: list[dict[str, Any]], kwargs: dict[str, Any]
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The template gets the tools (unless tool_choice is none) as transformers passes them; a template that
        does not render tools gets them as a system message, and tool calls and results as text it can render."""
        source = self._template_source()[0]
        messages = tool_messages(messages, source)
        offered = tools.template_tools()
        if offered is None:
            return messages, kwargs
        if "tools" in source:
            return messages, {**kwargs, "tools": offered}
        return [{"role": "system", "content": tools_system_prompt(offered)}, *messages], kwargs

    def _check_model(self, model: str | None) -> None:
        if not self.generation.engine.ready.is_set():
            raise ApiError(503, "no executor is connected; try again shortly")
        if model is not None and model != self.model_name():
            raise ApiError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    async def _chat_prompt(self, api: ApiRequest, messages: list[dict[str, Any]], kwargs: dict[str, Any]
                           ) -> list[int]:
        """The rendered conversation as token ids (the template writes any BOS itself, as in transformers).

        As for a completion's prompt, the size is bounded before any work (the messages' text cannot hold more
        than max_model_len tokens of the longest token), and a large conversation is rendered and tokenized on a
        worker thread, so that it never stalls the other streams of this api server."""
        limit = self.generation.request_limits().max_prompt_bytes
        message_bytes, kwargs_bytes = text_bytes(messages), text_bytes(kwargs)
        size = message_bytes + kwargs_bytes
        if size > limit:
            describe = self.generation.engine.describe
            max_model_len = describe.max_model_len if describe is not None else 0
            param = "chat_template_kwargs" if kwargs_bytes > message_bytes else "messages"
            raise bad_param(param, f"{size} bytes of text is more than max_model_len {max_model_len} tokens "
                            f"can hold (at most {limit} bytes)")
        template = self._template()
        describe = self.generation.engine.describe
        strip_bos = template.special_tokens.get("bos_token") if describe is not None and describe.add_bos_token \
            else None
        tokenizer = self.generation.tokenizer()

        def render() -> list[int]:
            text = template.render(messages, kwargs)
            if strip_bos and text.startswith(strip_bos):
                text = text[len(strip_bos):]
            return tokenizer.encode(text)

        if size <= INLINE_ENCODE_CHARS:
            ids = render()
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._render_pool, render)
        max_model_len = describe.max_model_len if describe is not None else 0
        if len(ids) >= max_model_len:
            raise bad_param("messages", f"the conversation is {len(ids)} tokens; max_model_len is {max_model_len}")
        room = max_model_len - len(ids)
        if not api.max_tokens_given and room > 0:
            api.sampling.max_tokens = room
        return ids

    def _template(self) -> ChatTemplate:
        source, tokenizer_json = self._template_source()
        if not source:
            raise ApiError(400, "this model has no chat template; use /v1/completions", "messages")
        if self._chat_template is None or self._chat_key != (source, tokenizer_json):
            self._chat_template = ChatTemplate(source, self._special_tokens(tokenizer_json))
            self._chat_key = (source, tokenizer_json)
        return self._chat_template

    def _template_source(self) -> tuple[str, str]:
        describe = self.generation.engine.describe
        tokenizer_json = describe.tokenizer_json if describe is not None else ""
        if self._tokenizer_dir:
            directory = Path(self._tokenizer_dir)
            config = read_json_file(directory / "tokenizer_config.json")
            jinja = directory / "chat_template.jinja"
            source = jinja.read_text(encoding="utf-8") if jinja.is_file() else config.get("chat_template", "")
            return (source if isinstance(source, str) else ""), (directory / "tokenizer.json").read_text()
        return (describe.chat_template if describe is not None else ""), tokenizer_json

    def _special_tokens(self, tokenizer_json: str) -> dict[str, str]:
        describe = self.generation.engine.describe
        if describe is None or not tokenizer_json:
            return {}
        tokenizer = Tokenizer.from_str(tokenizer_json)
        tokens = {"bos_token": tokenizer.id_to_token(describe.bos_token_id)}
        if describe.eos_token_ids:
            tokens["eos_token"] = tokenizer.id_to_token(describe.eos_token_ids[0])
        return {name: token for name, token in tokens.items() if token is not None}

    async def _serve(self, request: web.Request, api: ApiRequest, endpoint: Endpoint) -> web.StreamResponse:
        self._check_room(len(api.prompts))
        call_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
        requests = [generate_request(f"{call_id}-{i}", prompt, api) for i, prompt in enumerate(api.prompts)]
        n = api.sampling.n if api.sampling.HasField("n") else 1
        caller = self.generation.caller_of(presented_key(request))
        responses = merged([self.generation.generate(r, caller) for r in requests])
        async with contextlib.aclosing(responses):  # type: ignore[type-var]
            try:
                first = await anext(responses, None)
            except RequestError as e:
                raise named_for_http(from_status(e.code, e.message), api) from None
            wants = api.logprobs is not None or api.sampling.HasField("prompt_logprobs")
            formatter = LogprobFormatter(self.generation.tokenizer()) if wants else None
            stream = Stream(call_id, self.model_name() or "", endpoint, n, formatter, api.include_usage)
            stream.completion_logprobs = api.logprobs is not None
            stream.echo_logprobs = api.logprobs if api.echo else None
            stream.vllm_prompt_logprobs = api.prompt_logprobs
            if endpoint.chat and api.tools is not None and api.tools.choice is not ToolChoice.NONE:
                stream.tools = ToolAnswers(api.tools, self.tool_parser)
            stream.prompt_index = {r.request_id: i for i, r in enumerate(requests)}
            if api.echo:
                tokenizer = self.generation.tokenizer()
                stream.echo = {i: p if isinstance(p, str) else tokenizer.decode(list(p))
                               for i, p in enumerate(api.prompts)}
            if api.stream:
                return await stream.send(request, first, responses)
            return web.json_response(await stream.collect(first, responses))


    def _check_room(self, prompts: int) -> None:
        """A batch of prompts is one call each: refused before any of them starts if the api server can never hold
        that many open calls (400) or cannot now (429). Started one by one, 100,000 prompts in one body held the
        event loop 6 s, and every other client's request with it, before the call past the limit refused the lot."""
        generation = self.generation
        limit = generation.serving.max_open_calls
        if prompts > limit:
            raise bad_param("prompt", f"{prompts} prompts; this server holds at most {limit} open calls")
        if generation.open_calls + prompts > limit:
            raise generation.refuse(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{prompts} prompts: too many open calls "
                                    f"({generation.open_calls} of {limit}); retry later")


class Stream:
    """One call's responses as either a whole OpenAI response or a stream of SSE chunks."""

    def __init__(self, call_id: str, model: str, endpoint: Endpoint, n: int, formatter: LogprobFormatter | None,
                 include_usage: bool) -> None:
        self.call_id, self.model, self.endpoint, self.n = call_id, model, endpoint, n
        self.formatter, self.include_usage = formatter, include_usage
        self.created = int(time.time())
        self.usage = Usage()
        self.offsets: dict[int, int] = {}
        self.prompt_index: dict[str, int] = {}
        self.tools: ToolAnswers | None = None
        self.echo: dict[int, str] = {}  # prompt index -> its text, for echo (each choice's first text starts with it)
        self._echoed: set[int] = set()
        self.completion_logprobs = True  # the choices carry logprobs (the formatter may be there for prompt ones)
        self.echo_logprobs: int | None = None  # echo with logprobs k: the prompt's logprobs lead the choice's
        self.vllm_prompt_logprobs: int | None = None  # vLLM's prompt_logprobs k: each choice carries them
        self.prompts: dict[int, PromptLogprobs] = {}  # prompt index -> its logprobs (sequence 0 brings them)
        self._prompt_sent: set[int] = set()
        self._chunk_frame: tuple[bytes, bytes] | None = None  # a chunk event's bytes before and after its choice

    async def collect(self, first: generation_pb2.GenerateResponse | None,
                      rest: AsyncIterator[generation_pb2.GenerateResponse]) -> dict[str, Any]:
        choices: dict[int, Choice] = {}
        if first is not None:
            self._gather(first, choices)
            async for response in rest:
                self._gather(response, choices)
        if self.endpoint.chat:
            built = [chat_choice(choices[i], self.formatter) for i in sorted(choices)]
        else:
            built = [self._completion_choice(choices[i]) for i in sorted(choices)]
        if self.tools is not None:
            built = [self.tools.message(b) for b in built]
        return {"id": self.call_id, "object": self.endpoint.object, "created": self.created, "model": self.model,
                "choices": built, "usage": self.usage.body()}

    def _completion_choice(self, choice: Choice) -> dict[str, Any]:
        """A whole completion choice, with the prompt's logprobs where asked (they are every choice's of a prompt;
        sequence 0 brought them)."""
        built = completion_choice(choice, self.formatter if self.completion_logprobs else None)
        prompt = self.prompts.get(choice.index // self.n)
        f = self.formatter
        if prompt is not None and f is not None:
            if self.echo_logprobs is not None and built["logprobs"] is not None:
                built["logprobs"] = f.echoed(prompt, self.echo_logprobs, built["logprobs"])
            if self.vllm_prompt_logprobs is not None:
                built["prompt_logprobs"] = f.prompt_logprobs(prompt, self.vllm_prompt_logprobs)
        return built

    def _gather(self, response: generation_pb2.GenerateResponse, choices: dict[int, Choice]) -> None:
        prompt_index = self.prompt_index.get(response.request_id, 0)
        if response.prompt_logprobs or response.prompt_token_ids:
            self.prompts[prompt_index] = PromptLogprobs.of(response)
        index = prompt_index * self.n + response.index
        choice = choices.setdefault(index, Choice(index))
        choice.text.append(self._echo(prompt_index, index))
        choice.text.append(response.text)
        choice.logprobs.extend(response.logprobs)
        choice.finish_reason = finish_reason(response) or choice.finish_reason
        choice.stop_reason = stop_reason(response) if response.finish_reason else choice.stop_reason
        self.usage.add(prompt_index, response)

    async def send(self, request: web.Request, first: generation_pb2.GenerateResponse | None,
                   rest: AsyncIterator[generation_pb2.GenerateResponse]) -> web.StreamResponse:
        out = web.StreamResponse(headers=SSE_HEADERS)
        # A client that left shows as a write to a closing transport until aiohttp, a turn of the event loop later,
        # cancels this handler: a write between the two ended the handler with an ERROR traceback in the log (a few
        # per 100 clients that dropped their streams). Nothing to answer and nothing to log; the caller closes `rest`,
        # which aborts the call and frees what it held.
        with contextlib.suppress(ConnectionError):
            await out.prepare(request)
            await self._write_events(out, first, rest)
        return out

    async def _write_events(self, out: web.StreamResponse, first: generation_pb2.GenerateResponse | None,
                            rest: AsyncIterator[generation_pb2.GenerateResponse]) -> None:
        try:
            if first is not None:
                if self.endpoint.chat:
                    await out.write(self._event(self._role_chunk()))
                await self._write_chunk(out, first)
                async for response in rest:
                    await self._write_chunk(out, response)
            if self.include_usage:
                await out.write(self._event({**self._head(), "choices": [], "usage": self.usage.body()}))
        except (ApiError, RequestError) as e:
            error = e if isinstance(e, ApiError) else from_status(e.code, e.message)
            await out.write(self._event(error.body()))
        await out.write(b"data: [DONE]\n\n")

    async def _write_chunk(self, out: web.StreamResponse, response: generation_pb2.GenerateResponse) -> None:
        if self.tools is None:
            await out.write(self._chunk_event(response))
            return
        prompt_index = self.prompt_index.get(response.request_id, 0)
        self.usage.add(prompt_index, response)
        choice = self.tools.chunk_choice(prompt_index * self.n + response.index, response.text,
                                         finish_reason(response))
        if choice is not None:
            extra = {"usage": None} if self.include_usage else {}
            await out.write(self._event({**self._head(), "choices": [choice], **extra}))

    def _completion_chunk(self, response: generation_pb2.GenerateResponse, prompt_index: int, index: int,
                          reason: str | None) -> dict[str, Any]:
        """A completion choice's chunk: a choice's first leads with the echoed prompt and, where asked, its logprobs
        (OpenAI's echo) and vLLM's prompt_logprobs."""
        if response.prompt_logprobs or response.prompt_token_ids:
            self.prompts[prompt_index] = PromptLogprobs.of(response)
        echo = self._echo(prompt_index, index)
        f = self.formatter
        prompt = self.prompts.get(prompt_index)
        first = index not in self._prompt_sent
        self._prompt_sent.add(index)
        logprobs = None
        if f is not None and self.completion_logprobs:
            logprobs = f.completion(list(response.logprobs), self.offsets.get(index, 0))
            if first and self.echo_logprobs is not None and prompt is not None:
                logprobs = f.echoed(prompt, self.echo_logprobs, logprobs)
            self.offsets[index] = self.offsets.get(index, 0) + sum(len(t) for t in logprobs["tokens"])
        choice = {"index": index, "text": echo + response.text, "logprobs": logprobs, "finish_reason": reason}
        if first and f is not None and prompt is not None and self.vllm_prompt_logprobs is not None:
            choice["prompt_logprobs"] = f.prompt_logprobs(prompt, self.vllm_prompt_logprobs)
        return choice

    def _echo(self, prompt_index: int, index: int) -> str:
        """The prompt's text the first time choice `index` answers, with echo; "" otherwise."""
        if not self.echo or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self.echo.get(prompt_index, "")

    def _head(self) -> dict[str, Any]:
        return {"id": self.call_id, "object": self.endpoint.chunk_object, "created": self.created,
                "model": self.model}

    def _event(self, data: dict[str, Any]) -> bytes:
        return f"data: {dumps(data)}\n\n".encode()

    def _role_chunk(self) -> dict[str, Any]:
        choices = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None} for i in range(self.n)]
        return {**self._head(), "choices": choices, **({"usage": None} if self.include_usage else {})}

    def _chunk_event(self, response: generation_pb2.GenerateResponse) -> bytes:
        """The SSE event of one response's chunk: its fixed part (id, object, created, model; the usage placeholder)
        rendered once per stream, the choice per chunk; the same bytes as _event of the whole chunk's dict."""
        if self._chunk_frame is None:
            fixed = dumps({**self._head(), "choices": None, **({"usage": None} if self.include_usage else {})})
            before, _, after = fixed.rpartition('"choices":null')  # after the model's name, whatever it holds
            self._chunk_frame = (f"data: {before}\"choices\":[".encode(), f"]{after}\n\n".encode())
        head, tail = self._chunk_frame
        return head + dumps(self._choice(response)).encode() + tail

    def _choice(self, response: generation_pb2.GenerateResponse) -> dict[str, Any]:
        prompt_index = self.prompt_index.get(response.request_id, 0)
        index = prompt_index * self.n + response.index
        self.usage.add(prompt_index, response)
        reason = finish_reason(response)
        f = self.formatter
        if self.endpoint.chat:
            delta = {"content": response.text} if response.text or reason is None else {}
            logprobs = f.chat(list(response.logprobs)) if f is not None else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = self._completion_chunk(response, prompt_index, index, reason)
        if reason is not None:
            choice["stop_reason"] = stop_reason(response)
        return choice


def named_for_http(error: ApiError, api: ApiRequest) -> ApiError:
    """A refusal of the constraint names the body parameter that gave it (response_format, tools, ...)."""
    if error.param == "structured_outputs" and api.constraint_param is not None:
        error.param = api.constraint_param
    return error


def generate_request(request_id: str, prompt: str | list[int], api: ApiRequest) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(request_id=request_id)
    request.sampling.CopyFrom(api.sampling)
    if api.cache_salt is not None:
        request.cache_salt = api.cache_salt
    if isinstance(prompt, str):
        request.prompt = prompt
    else:
        request.prompt_token_ids.extend(prompt)
    return request


def merged(streams: list[AsyncIterator[generation_pb2.GenerateResponse]]
           ) -> AsyncIterator[generation_pb2.GenerateResponse]:
    """The responses of every stream as they come (one stream is passed through as it is); closing the
    result closes them all."""
    if len(streams) == 1:
        return streams[0]
    return interleaved(streams)


async def interleaved(streams: list[AsyncIterator[generation_pb2.GenerateResponse]]
                      ) -> AsyncIterator[generation_pb2.GenerateResponse]:
    queue: asyncio.Queue[generation_pb2.GenerateResponse | RequestError | None] = asyncio.Queue()
    tasks = [asyncio.create_task(pump(s, queue)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, RequestError):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def pump(stream: AsyncIterator[generation_pb2.GenerateResponse],
               queue: asyncio.Queue[generation_pb2.GenerateResponse | RequestError | None]) -> None:
    try:
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for response in stream:
                queue.put_nowait(response)
    except RequestError as e:
        queue.put_nowait(e)
    queue.put_nowait(None)


def presented_key(request: web.Request) -> str:
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("X-Api-Key", "").strip()


async def read_json(request: web.Request) -> Any:
    """The body as JSON, which is UTF-8 (RFC 8259): another declared charset is a 415, a body that cannot be read
    (a connection lost mid-body) a 400, never a 500."""
    charset = (request.charset or "utf-8").lower()
    if charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"Unsupported Media Type: JSON bodies are UTF-8, not charset={charset!r}")
    try:
        data = await request.read()
    except (RequestPayloadError, HttpProcessingError) as e:
        raise ApiError(400, f"the request body could not be read: {e}") from None
    check_value_count(data)
    try:
        body = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    check_body(body)
    return body


def read_json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(slots=True)
class HttpServer:
    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def serve_http(api: OpenAIApi, listen: str, tls_cert: str | None = None, tls_key: str | None = None,
                     reuse_port: bool = False, limits: HttpLimits | None = None,
                     max_connections: int | None = None) -> HttpServer:
    """Start the HTTP API on HOST:PORT (port 0 picks a free one); HTTPS when a certificate is given. Its connections
    are guarded (connections.py): header and body timeouts, the keep-alive timeout, at most max_connections
    (default: limits.max_connections)."""
    limits = limits or HttpLimits()
    host, _, port = listen.rpartition(":")
    context = None
    if tls_cert and tls_key:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls_cert, tls_key)
    guard = ConnectionGuard(limits, max_connections or limits.max_connections)
    # auto_decompress off: aiohttp inflated a gzip body on the event loop as it arrived (up to the 64 MiB limit
    # per request: ~4.5 s of loop time per 500 MB of bombs); the guard refuses any Content-Encoding with a 415.
    runner = web.AppRunner(api.app(guard), handler_cancellation=True, access_log=None,
                           keepalive_timeout=limits.keep_alive_timeout, auto_decompress=False)
    await runner.setup()
    site = GuardedSite(runner, guard, host.strip("[]") or "0.0.0.0", int(port), ssl_context=context,
                       reuse_port=reuse_port)
    await site.start()
    return HttpServer(runner, runner.addresses[0][1])
