"""Send the benchmark requests on a gamma arrival schedule and record per-request timestamps."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from client.bench.datasets import BenchRequest
from client.bench.progress import make_progress
from client.bench.stats import RequestTrace
from client.lib import PagedServeClient
from protos.pagedserve.v1 import common_pb2, generation_pb2

ARRIVAL_STREAM = 0xA441
FAILED_REASONS = {generation_pb2.FINISH_REASON_ERROR: "error", generation_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass(frozen=True, slots=True)
class RunConfig:
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    output_len_hint: bool = False
    timeout: float | None = None
    show_progress: bool = True


@dataclass(frozen=True, slots=True)
class RunResult:
    config: RunConfig
    traces: tuple[RequestTrace, ...]
    duration: float
    started_at: float = field(default_factory=time.time)


class BenchClient(Protocol):
    """A client that sends one benchmark request itself (bench --backend openai)."""

    async def send_one(self, req: BenchRequest, cfg: RunConfig, t0: float) -> RequestTrace: ...


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds from the start: the first at 0, then Gamma(shape=b, scale=1/(rate*b)) gaps."""
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = np.random.default_rng([seed, ARRIVAL_STREAM])  # not the dataset's stream for the same seed
    gaps = rng.gamma(burstiness, 1 / (rate * burstiness), size=n - 1)
    return [0.0, *(float(x) for x in np.cumsum(gaps))]


def sampling_args(req: BenchRequest, cfg: RunConfig) -> dict[str, Any]:
    args: dict[str, Any] = {"max_tokens": req.max_tokens, "temperature": cfg.temperature}
    if req.json_schema is not None:
        args["structured_outputs"] = common_pb2.StructuredOutputs(json=req.json_schema)
    elif cfg.ignore_eos:  # a constrained output ends where its grammar does
        args["ignore_eos"] = True
    if cfg.output_len_hint:
        args["output_len_hint"] = req.max_tokens
    return args


async def send_one(client: PagedServeClient, req: BenchRequest, cfg: RunConfig, t0: float) -> RequestTrace:
    """Stream one request; times are seconds since t0 on time.perf_counter()."""
    chunks: list[float] = []
    texts: list[str] = []
    output_len, error = 0, ""
    start = time.perf_counter() - t0
    try:
        ids = list(req.prompt_token_ids) if req.prompt_token_ids is not None else None
        async for r in client.generate(req.prompt, ids, timeout=cfg.timeout, **sampling_args(req, cfg)):
            if r.token_ids:
                chunks.append(time.perf_counter() - t0)
                output_len += len(r.token_ids)
                texts.append(r.text)
            if r.finish_reason in FAILED_REASONS:
                error = f"{FAILED_REASONS[r.finish_reason]}: {r.error}"
    except grpc.aio.AioRpcError as e:
        error = f"{e.code().name}: {e.details()}"
    return RequestTrace(prompt_len=req.prompt_len, start=start, end=time.perf_counter() - t0,
                        chunk_times=tuple(chunks), output_len=output_len, success=not error, error=error,
                        text="".join(texts))


async def run_benchmark(client: PagedServeClient | BenchClient, requests: Sequence[BenchRequest], cfg: RunConfig,
                        desc: str = "") -> RunResult:
    """One full run: every request sent at its arrival time (waiting for a concurrency slot if capped)."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = make_progress(len(requests), cfg.show_progress, desc)
    started_at = time.time()
    t0 = time.perf_counter()

    async def launch(req: BenchRequest, offset: float) -> RequestTrace:
        delay = t0 + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots or nullcontext():
            trace = await (send_one(client, req, cfg, t0) if isinstance(client, PagedServeClient)
                           else client.send_one(req, cfg, t0))
        bar.update(1)
        return trace

    try:
        traces = await asyncio.gather(*(launch(r, o) for r, o in zip(requests, offsets, strict=True)))
    finally:
        bar.close()
    return RunResult(config=cfg, traces=tuple(traces), duration=time.perf_counter() - t0, started_at=started_at)
