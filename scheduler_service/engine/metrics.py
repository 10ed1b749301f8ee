"""Prometheus metrics under vLLM's names, so existing dashboards work."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric

from scheduler_service.core.request import FinishReason
from scheduler_service.core.scheduler import SchedulerStats
from scheduler_service.core.speculative import SpecDecodeStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
MODEL = ["model_name"]
EXECUTOR = ["model_name", "executor"]
log = logging.getLogger("pagedserve.scheduler")
MAX_METRICS_CONNECTIONS = 1024
METRICS_IDLE_TIMEOUT_S = 10.0
MAX_HTTP_HEADER_BYTES = 16 * 1024


class StepHistogram:
    """A histogram for per-token series: observe() only records the sample; flush(), once per engine step,
    buckets the step's samples together. prometheus_client's Histogram costs ~0.7 µs per observe, which at
    hundreds of running requests is a real share of a step."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self._name, self._doc, self._model_name = name, doc, model_name
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self._sum = 0.0
        self._pending: list[float] = []
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float) -> None:
        self._pending.append(value)

    def flush(self) -> None:
        if not self._pending:
            return
        values, self._pending = self._pending, []
        index = np.searchsorted(self._bounds, values, side="left")
        counts = np.bincount(index, minlength=len(self._counts))
        with self._lock:
            self._counts += counts
            self._sum += math.fsum(values)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=MODEL)
        bounds = [*(repr(float(b)) for b in self._bounds), "+Inf"]
        family.add_metric([self._model_name], list(zip(bounds, cumulative, strict=True)), total)
        yield family


@dataclass(slots=True)
class ExecutorSeries:
    """One executor's labelled series, bound once when it joins the pool."""

    step_time: Histogram
    executor_step_time: Histogram
    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    device_blocks: Gauge
    serving: Gauge
    executor_busy: Counter
    startup: Gauge


class EngineMetrics:
    """Pool totals under vLLM's names, plus per-executor series labelled `executor`. Every series is bound
    to its labels once, when created: no label lookups on the hot path."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, MODEL, registry=r).labels(m)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, MODEL, registry=r).labels(m)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, MODEL, buckets=buckets, registry=r).labels(m)

        self.running = gauge("vllm:num_requests_running", "Requests in the RUNNING state")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests in the WAITING state")
        self.swapped = gauge("vllm:num_requests_swapped", "Requests in the SWAPPED state")
        self.gpu_usage = gauge("vllm:gpu_cache_usage_perc", "Fraction of device KV blocks in use (0-1)")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "Fraction of device KV blocks in use (0-1)")
        self.cpu_usage = gauge("vllm:cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0-1)")
        self.device_blocks_used = gauge("pagedserve:device_blocks_used", "Device KV blocks held")
        self.cpu_blocks_used = gauge("pagedserve:cpu_blocks_used", "CPU swap blocks held")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache on admission")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        by_mode = Counter("pagedserve:num_preemptions_by_mode", "Preemptions by mode", [*MODEL, "mode"], registry=r)
        self.preemptions_swap = by_mode.labels(m, "swap")
        self.preemptions_recompute = by_mode.labels(m, "recompute")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Decodes sent with drafts")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens sent for verification")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens the executor accepted")
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at "
                                     "each draft position (0 = the first draft)", [*MODEL, "position"], registry=r)
        self._spec_positions: list[Counter] = []
        self.swap_in_blocks = counter("pagedserve:swap_in_blocks", "Blocks swapped in")
        self.swap_out_blocks = counter("pagedserve:swap_out_blocks", "Blocks swapped out")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        success = Counter("vllm:request_success", "Finished requests", [*MODEL, "finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason.value) for reason in FinishReason}
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = StepHistogram("vllm:inter_token_latency_seconds", "Time between output tokens", m,
                                 LATENCY_BUCKETS, r)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Time in WAITING before first scheduled")
        self._families: dict[str, Any] = {
            "step_time": Histogram("pagedserve:scheduler_step_seconds", "schedule()+update() time per step",
                                   EXECUTOR, buckets=STEP_BUCKETS, registry=r),
            "executor_step_time": Histogram("pagedserve:executor_step_seconds", "Executor round trip per step",
                                            EXECUTOR, buckets=STEP_BUCKETS, registry=r),
            "running": Gauge("pagedserve:executor_num_requests_running", "RUNNING requests on one executor",
                             EXECUTOR, registry=r),
            "waiting": Gauge("pagedserve:executor_num_requests_waiting", "WAITING requests on one executor",
                             EXECUTOR, registry=r),
            "kv_usage": Gauge("pagedserve:executor_kv_cache_usage_perc", "Fraction of one executor's device KV "
                              "blocks in use (0-1)", EXECUTOR, registry=r),
            "device_blocks": Gauge("pagedserve:executor_num_device_blocks", "Device KV blocks one executor has",
                                   EXECUTOR, registry=r),
            "serving": Gauge("pagedserve:executor_serving", "1 while the executor serves, else 0", EXECUTOR,
                             registry=r),
            "executor_busy": Counter("pagedserve:executor_busy_seconds", "Time the executor reports spending in "
                                     "its steps (its busy fraction is the rate of this)", EXECUTOR, registry=r),
            "startup": Gauge("pagedserve:executor_startup_seconds", "Seconds from the executor process's start to "
                             "ready, as its Describe reports (0: not reported)", EXECUTOR, registry=r),
        }
        self._stats: dict[str, SchedulerStats] = {}
        self._series: dict[str, ExecutorSeries] = {}
        self._capacity: dict[str, tuple[int, int]] = {}
        self._seen: dict[tuple[str, str], int] = {}

    def executor_series(self, executor: str) -> ExecutorSeries:
        kids = {name: family.labels(self.model_name, executor) for name, family in self._families.items()}
        series = self._series[executor] = ExecutorSeries(**kids)
        return series

    def set_capacity(self, executor: str, device_blocks: int, cpu_blocks: int) -> None:
        self._capacity[executor] = (device_blocks, cpu_blocks)

    def forget_executor(self, executor: str) -> None:
        """An executor left the pool: its series go, and the totals no longer count it."""
        self._stats.pop(executor, None)
        self._series.pop(executor, None)
        self._capacity.pop(executor, None)
        self._seen = {k: v for k, v in self._seen.items() if k[0] != executor}
        for family in self._families.values():
            with contextlib.suppress(KeyError):
                family.remove(self.model_name, executor)
        self._set_totals()

    def observe_stats(self, s: SchedulerStats, executor: str = "") -> None:
        self._stats[executor] = s
        series = self._series.get(executor)
        if series is not None:
            series.running.set(s.num_running)
            series.waiting.set(s.num_waiting)
            series.kv_usage.set(s.device_usage)
        self._advance(executor, "swap", s.num_preemptions_swap, self.preemptions_swap)
        self._advance(executor, "recompute", s.num_preemptions_recompute, self.preemptions_recompute)
        self._advance(executor, "total", s.num_preemptions_swap + s.num_preemptions_recompute, self.preemptions)
        self._advance(executor, "in", s.num_swapped_in_blocks, self.swap_in_blocks)
        self._advance(executor, "out", s.num_swapped_out_blocks, self.swap_out_blocks)
        self._advance(executor, "prefix_queries", s.prefix_cache_queries, self.prefix_cache_queries)
        self._advance(executor, "prefix_hits", s.prefix_cache_hits, self.prefix_cache_hits)
        if s.spec is not None and s.spec.num_drafts:
            self._observe_spec(executor, s.spec)
        self._set_totals()

    def _observe_spec(self, executor: str, spec: SpecDecodeStats) -> None:
        self._advance(executor, "spec_drafts", spec.num_drafts, self.spec_drafts)
        self._advance(executor, "spec_draft_tokens", spec.num_draft_tokens, self.spec_draft_tokens)
        self._advance(executor, "spec_accepted", spec.num_accepted_tokens, self.spec_accepted)
        positions = self._spec_positions
        for i, accepted in enumerate(spec.accepted_per_pos or ()):
            if i == len(positions):
                positions.append(self._spec_per_pos.labels(self.model_name, str(i)))
            self._advance(executor, f"spec_pos_{i}", accepted, positions[i])

    def _set_totals(self) -> None:
        stats = self._stats.values()
        device_used = sum(s.device_blocks_used for s in stats)
        cpu_used = sum(s.cpu_blocks_used for s in stats)
        self.running.set(sum(s.num_running for s in stats))
        self.waiting.set(sum(s.num_waiting for s in stats))
        self.swapped.set(sum(s.num_swapped for s in stats))
        self.device_blocks_used.set(device_used)
        self.cpu_blocks_used.set(cpu_used)
        if len(self._stats) == 1 or not self._capacity:
            device_usage = max((s.device_usage for s in stats), default=0.0)
            cpu_usage = max((s.cpu_usage for s in stats), default=0.0)
        else:
            device_total = sum(c[0] for c in self._capacity.values())
            cpu_total = sum(c[1] for c in self._capacity.values())
            device_usage = device_used / device_total if device_total else 0.0
            cpu_usage = cpu_used / cpu_total if cpu_total else 0.0
        self.gpu_usage.set(device_usage)
        self.kv_usage.set(device_usage)
        self.cpu_usage.set(cpu_usage)

    def _advance(self, executor: str, key: str, value: int, child: Counter) -> None:
        seen = self._seen.get((executor, key), 0)
        if value > seen:
            child.inc(value - seen)
        self._seen[(executor, key)] = value

    def on_finish(self, reason: FinishReason, e2e: float) -> None:
        self.success[reason].inc()
        self.e2e.observe(e2e)



@dataclass(slots=True)
class MetricsServer:
    """/metrics over HTTP/1.1 on the service's own event loop: no thread per connection; at most
    MAX_METRICS_CONNECTIONS open at once (more are closed at once), each closed after
    METRICS_IDLE_TIMEOUT_S without a complete request."""

    registry: CollectorRegistry
    server: asyncio.Server | None = None
    writers: set[asyncio.StreamWriter] = field(default_factory=set)

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._serve, host, port, limit=MAX_HTTP_HEADER_BYTES)
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            for writer in list(self.writers):
                writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.writers) >= MAX_METRICS_CONNECTIONS:
            writer.close()
            return
        self.writers.add(writer)
        try:
            while await self._answer_one(reader, writer):
                pass
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection should close."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), METRICS_IDLE_TIMEOUT_S)
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(request_line) != 3:
            return False
        method, target = request_line[0], request_line[1].split("?", 1)[0]
        keep_alive = b"connection: close" not in head.lower()
        if method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"GET only\n", "text/plain"
        elif target in ("/metrics", "/"):
            status, body, ctype = "200 OK", generate_latest(self.registry), CONTENT_TYPE_LATEST
        else:
            status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
        header = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                  f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n").encode()
        writer.write(header + (body if method == "GET" else b""))
        await writer.drain()
        return keep_alive
