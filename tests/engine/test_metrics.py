"""The batched per-token histogram exposes exactly what prometheus_client's Histogram would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_service.core.scheduler import SchedulerStats
from scheduler_service.core.speculative import SpecDecodeStats
from scheduler_service.engine.metrics import LATENCY_BUCKETS, EngineMetrics, StepHistogram

NAME = "vllm:inter_token_latency_seconds"


def samples(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith("#") or "_created" in line:
            continue
        key, value = line.rsplit(" ", 1)
        out[key] = float(value)
    return out


def test_step_histogram_matches_prometheus_histogram() -> None:
    fast_registry, ref_registry = CollectorRegistry(), CollectorRegistry()
    fast = StepHistogram(NAME, "doc", "m", LATENCY_BUCKETS, fast_registry)
    ref = Histogram(NAME, "doc", ["model_name"], buckets=LATENCY_BUCKETS, registry=ref_registry).labels("m")
    rng = random.Random(3)
    for step in range(20):
        for value in [rng.expovariate(20) for _ in range(50)] + list(LATENCY_BUCKETS[step % 5::7]) + [1e3]:
            fast.observe(value)
            ref.observe(value)
        fast.flush()
    got, want = samples(fast_registry), samples(ref_registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_unflushed_samples_are_not_exposed_yet() -> None:
    registry = CollectorRegistry()
    h = StepHistogram(NAME, "doc", "m", LATENCY_BUCKETS, registry)
    h.observe(0.5)
    assert samples(registry)[f'{NAME}_count{{model_name="m"}}'] == 0
    h.flush()
    assert samples(registry)[f'{NAME}_count{{model_name="m"}}'] == 1


async def test_metrics_are_served_from_the_event_loop_without_a_thread_per_connection() -> None:
    import asyncio
    import threading

    from scheduler_service.engine.metrics import EngineMetrics, MetricsServer

    metrics = EngineMetrics("m")
    server = MetricsServer(metrics.registry)
    port = await server.start("127.0.0.1", 0)
    threads = threading.active_count()
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(300)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert response.startswith(b"HTTP/1.1 200 OK")
        assert b"vllm:num_requests_running" in response
        assert threading.active_count() < threads + 5, "no thread per connection (others may start their own)"
        assert len(server.writers) == 300
    finally:
        for _, w in idle:
            w.close()
        await server.close()


async def test_metrics_connections_are_bounded() -> None:
    import asyncio

    from scheduler_service.engine import metrics as metrics_module
    from scheduler_service.engine.metrics import EngineMetrics, MetricsServer

    server = MetricsServer(EngineMetrics("m").registry)
    port = await server.start("127.0.0.1", 0)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(metrics_module.MAX_METRICS_CONNECTIONS)]
    try:
        deadline = asyncio.get_running_loop().time() + 30  # the server has accepted every one of them
        while len(server.writers) < metrics_module.MAX_METRICS_CONNECTIONS:
            assert asyncio.get_running_loop().time() < deadline, f"{len(server.writers)} connections accepted"
            await asyncio.sleep(0.01)
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(), 10) == b"", "a connection past the bound is closed at once"
    finally:
        for _, w in held:
            w.close()
        await server.close()


def test_spec_decode_counters_follow_the_schedulers_totals() -> None:
    metrics = EngineMetrics("m")
    spec = SpecDecodeStats()
    stats = SchedulerStats(1, 0, 0, 0.1, 0.0, 1, 0, 0, 0, 0, 0, spec=spec)
    spec.record(3, 2)
    metrics.observe_stats(stats, "e")
    spec.record(4, 4)
    spec.record(2, 0)
    metrics.observe_stats(stats, "e")
    got = samples(metrics.registry)
    assert got['vllm:spec_decode_num_drafts_total{model_name="m"}'] == 3
    assert got['vllm:spec_decode_num_draft_tokens_total{model_name="m"}'] == 9
    assert got['vllm:spec_decode_num_accepted_tokens_total{model_name="m"}'] == 6
    per_pos = [got[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{i}"}}']
               for i in range(4)]
    assert per_pos == [2, 2, 1, 1]
