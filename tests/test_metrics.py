"""The batched per-token histogram exposes exactly what prometheus_client's Histogram would."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from scheduler_service.metrics import LATENCY_BUCKETS, StepHistogram

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
