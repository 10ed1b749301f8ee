"""Benchmark metrics from per-request timestamps; pure functions, vLLM's definitions.

All times in a RequestTrace are seconds on one monotonic clock; reported latencies are milliseconds.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

SLO_KEYS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """What the runner saw of one request."""

    prompt_len: int
    start: float                       # when the request was sent
    end: float                         # when its stream finished (or failed)
    chunk_times: tuple[float, ...] = ()  # arrival of every response that carried tokens
    output_len: int = 0                # tokens received
    success: bool = True
    error: str = ""
    text: str = ""
    resent: bool = False               # sent again after a reused connection was lost before any response


@dataclass(frozen=True, slots=True)
class Distribution:
    """mean / median / std / selected percentiles, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    std: float = 0.0
    percentiles: dict[float, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SLO:
    """Goodput thresholds in milliseconds; None means not constrained."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft, self.tpot, self.e2el))


@dataclass(frozen=True, slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration: float
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution


def ttft(trace: RequestTrace) -> float:
    """Time to the first token; the whole latency when no token came."""
    return (trace.chunk_times[0] if trace.chunk_times else trace.end) - trace.start


def e2el(trace: RequestTrace) -> float:
    return trace.end - trace.start


def tpot(trace: RequestTrace) -> float | None:
    """(E2EL - TTFT) / (output_len - 1); None for outputs of one token or fewer."""
    if trace.output_len <= 1:
        return None
    return (e2el(trace) - ttft(trace)) / (trace.output_len - 1)


def itls(trace: RequestTrace) -> list[float]:
    """Every gap between consecutive token-carrying chunks."""
    t = trace.chunk_times
    return [b - a for a, b in itertools.pairwise(t)]


def meets_slo(trace: RequestTrace, slo: SLO) -> bool:
    """vLLM's goodput test: all given SLOs met; a one-token output counts as TPOT 0."""
    checks = ((slo.ttft, ttft(trace)), (slo.tpot, tpot(trace) or 0.0), (slo.e2el, e2el(trace)))
    return all(limit is None or value * 1000 <= limit for limit, value in checks)


def distribution(seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution:
    """Summary in ms; numpy's linear-interpolation percentiles; all zeros for no samples."""
    if not seconds:
        return Distribution(percentiles={p: 0.0 for p in percentiles})
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    return Distribution(mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()),
                        percentiles={p: float(np.percentile(ms, p)) for p in percentiles})


def compute_metrics(traces: Sequence[RequestTrace], duration: float, percentiles: Sequence[float] = (99,),
                    slo: SLO | None = None) -> BenchMetrics:
    ok = [t for t in traces if t.success]
    total_input = sum(t.prompt_len for t in ok)
    total_output = sum(t.output_len for t in ok)
    per_s = 1 / duration if duration > 0 else 0.0
    goodput = sum(meets_slo(t, slo) for t in ok) * per_s if slo is not None and slo.is_set() else None
    tpots = [v for v in (tpot(t) for t in ok) if v is not None]
    return BenchMetrics(
        completed=len(ok), failed=len(traces) - len(ok), duration=duration, total_input=total_input,
        total_output=total_output, request_throughput=len(ok) * per_s, request_goodput=goodput,
        output_throughput=total_output * per_s, total_token_throughput=(total_input + total_output) * per_s,
        ttft=distribution([ttft(t) for t in ok], percentiles), tpot=distribution(tpots, percentiles),
        itl=distribution([gap for t in ok for gap in itls(t)], percentiles),
        e2el=distribution([e2el(t) for t in ok], percentiles))


def parse_goodput(items: Sequence[str]) -> SLO:
    """['ttft:500', 'tpot:50'] -> SLO(ttft=500, tpot=50); raises ValueError naming the bad item."""
    values: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: expected KEY:MS with KEY one of {', '.join(SLO_KEYS)}")
        try:
            values[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if values[key] < 0:
            raise ValueError(f"--goodput {item!r}: must be >= 0")
    return SLO(**values)


def percentile_label(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9' (vLLM's JSON key spelling)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of values (q in [0, 1]); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
