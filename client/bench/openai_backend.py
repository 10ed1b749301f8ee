"""`bench --backend openai`: the same requests over an OpenAI-compatible /v1/completions stream (aiohttp, SSE)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import aiohttp

from client.bench.datasets import BenchRequest
from client.bench.runner import RunConfig
from client.bench.stats import RequestTrace

FAILED_REASONS = ("abort", "error")


def api_root(base_url: str) -> str:
    """http://host:port or http://host:port/v1 -> http://host:port/v1"""
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else f"{root}/v1"


class OpenAIBenchClient:
    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None) -> None:
        self.root = api_root(base_url)
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> OpenAIBenchClient:
        connector = aiohttp.TCPConnector(limit=0)
        reuse = aiohttp.TraceConfig()
        reuse.on_connection_reuseconn.append(note_reuse)
        self._session = aiohttp.ClientSession(connector=connector, headers=self._headers,
                                              timeout=aiohttp.ClientTimeout(total=None), trace_configs=[reuse])
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use `async with OpenAIBenchClient(...)`")
        return self._session

    async def check(self) -> bool:
        """The server answers /v1/models; picks its first model when --model was not given."""
        try:
            async with self.session.get(f"{self.root}/models", timeout=aiohttp.ClientTimeout(total=10)) as r:
                body = await r.json(content_type=None)
                if r.status != 200:
                    print(f"error: {self.root}/models: HTTP {r.status}: {body}", file=sys.stderr)
                    return False
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            print(f"error: {self.root} unreachable: {e!r}", file=sys.stderr)
            return False
        if self.model is None and body.get("data"):
            self.model = body["data"][0]["id"]
        return True

    def body(self, req: BenchRequest, cfg: RunConfig) -> dict[str, Any]:
        prompt: str | list[int] = req.prompt if req.prompt is not None else list(req.prompt_token_ids or ())
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": req.max_tokens,
                                "temperature": cfg.temperature, "stream": True,
                                "stream_options": {"include_usage": True}}
        if req.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": json.loads(req.json_schema), "strict": True}}
        elif cfg.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def send_one(self, req: BenchRequest, cfg: RunConfig, t0: float) -> RequestTrace:
        """Stream one completion; chunk times are when text arrived, output_len is the reported usage. A request
        sent on a reused keep-alive connection that is lost before any response (the server had closed it as the
        request went: llama-server closes a keep-alive connection after a few requests; aiohttp raises
        ServerDisconnectedError, or ClientOSError writing the body) is sent once more, on another connection, and
        its trace says so (`resent`); a request lost on a new connection, or after its answer began, is not."""
        start = time.perf_counter() - t0
        reused: list[bool] = []
        try:
            return await self._stream(req, cfg, t0, start, reused)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            if not reused or isinstance(e, aiohttp.ClientConnectorError):
                return failed(req, start, t0, describe(e))
        except (aiohttp.ClientError, TimeoutError) as e:
            return failed(req, start, t0, describe(e))
        try:
            return replace(await self._stream(req, cfg, t0, start, []), resent=True)
        except (aiohttp.ClientError, TimeoutError) as e:
            return replace(failed(req, start, t0, describe(e)), resent=True)

    async def _stream(self, req: BenchRequest, cfg: RunConfig, t0: float, start: float,
                      reused: list[bool]) -> RequestTrace:
        """The request's trace; raises what the session raised before a response came (errors after it are the
        trace's). `reused` gets an entry if the request went on a pooled connection."""
        chunks: list[float] = []
        texts: list[str] = []
        output_len, error = 0, ""
        timeout = aiohttp.ClientTimeout(total=cfg.timeout)
        async with self.session.post(f"{self.root}/completions", json=self.body(req, cfg), timeout=timeout,
                                     trace_request_ctx=reused) as r:
            try:
                if r.status != 200:
                    return failed(req, start, t0, f"HTTP {r.status}: {(await r.text())[:200]}")
                async for line in r.content:
                    event = parse_event(line)
                    if event is None:
                        continue
                    if "error" in event:
                        error = str(event["error"].get("message"))
                    for choice in event.get("choices") or ():
                        if choice.get("text"):
                            chunks.append(time.perf_counter() - t0)
                            texts.append(choice["text"])
                        if choice.get("finish_reason") in FAILED_REASONS:
                            error = str(choice["finish_reason"])
                    if event.get("usage"):
                        output_len = event["usage"]["completion_tokens"]
            except (aiohttp.ClientError, TimeoutError) as e:
                error = describe(e)
        return RequestTrace(prompt_len=req.prompt_len, start=start, end=time.perf_counter() - t0,
                            chunk_times=tuple(chunks), output_len=output_len, success=not error, error=error,
                            text="".join(texts))


async def note_reuse(session: aiohttp.ClientSession, context: SimpleNamespace,
                     params: aiohttp.TraceConnectionReuseconnParams) -> None:
    """A request went on a pooled connection: its trace_request_ctx (a list) gets an entry."""
    if isinstance(context.trace_request_ctx, list):
        context.trace_request_ctx.append(True)


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def failed(req: BenchRequest, start: float, t0: float, error: str) -> RequestTrace:
    return RequestTrace(prompt_len=req.prompt_len, start=start, end=time.perf_counter() - t0, chunk_times=(),
                        output_len=0, success=False, error=error, text="")


def parse_event(line: bytes) -> dict[str, Any] | None:
    if not line.startswith(b"data: "):
        return None
    payload = line[6:].strip()
    if payload == b"[DONE]":
        return None
    return json.loads(payload)
