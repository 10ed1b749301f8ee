"""The human table (laid out like vLLM's) and the JSON result (vLLM's key names)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from client.bench.runner import RunResult
from client.bench.stats import BenchMetrics, Distribution, e2el, itls, percentile_label, tpot, ttft

WIDTH = 50
LATENCIES = (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
             ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def row(name: str, value: float | int | str) -> str:
    if isinstance(value, float):
        return f"{name:<40} {value:<10.2f}"
    return f"{name:<40} {value!s:<10}"


def title(text: str, fill: str) -> str:
    return f"{text:{fill}^{WIDTH}}"


def latency_rows(name: str, short: str, dist: Distribution) -> list[str]:
    lines = [title(name, "-"), row(f"Mean {short} (ms):", dist.mean), row(f"Median {short} (ms):", dist.median)]
    lines += [row(f"{percentile_label(p).upper()} {short} (ms):", v) for p, v in dist.percentiles.items()]
    return lines


def format_table(result: RunResult, m: BenchMetrics) -> str:
    cfg = result.config
    lines = [title(" Serving Benchmark Result ", "="), row("Successful requests:", m.completed),
             row("Failed requests:", m.failed), row("Request rate (req/s):", rate_label(cfg.request_rate))]
    if cfg.max_concurrency:
        lines.append(row("Maximum request concurrency:", cfg.max_concurrency))
    lines += [row("Benchmark duration (s):", m.duration), row("Total input tokens:", m.total_input),
              row("Total generated tokens:", m.total_output),
              row("Request throughput (req/s):", m.request_throughput)]
    if m.request_goodput is not None:
        lines.append(row("Request goodput (req/s):", m.request_goodput))
    lines += [row("Output token throughput (tok/s):", m.output_throughput),
              row("Total Token throughput (tok/s):", m.total_token_throughput)]
    for key, short, name in LATENCIES:
        lines += latency_rows(name, short, getattr(m, key))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def result_dict(result: RunResult, m: BenchMetrics, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg, ok = result.config, [t for t in result.traces if t.success]
    out: dict[str, Any] = {
        "date": datetime.fromtimestamp(result.started_at).strftime("%Y%m%d-%H%M%S"),
        **(extra or {}),
        "num_prompts": len(result.traces),
        "request_rate": rate_label(cfg.request_rate) if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency,
        "duration": m.duration, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "input_lens": [t.prompt_len for t in ok], "output_lens": [t.output_len for t in ok],
        "ttfts": [ttft(t) for t in ok], "tpots": [tpot(t) for t in ok], "e2els": [e2el(t) for t in ok],
        "itls": [itls(t) for t in ok], "generated_texts": [t.text for t in ok],
        "errors": [t.error for t in result.traces if not t.success],
    }
    for key, _, _ in LATENCIES:
        dist: Distribution = getattr(m, key)
        out.update({f"mean_{key}_ms": dist.mean, f"median_{key}_ms": dist.median, f"std_{key}_ms": dist.std})
        out.update({f"{percentile_label(p)}_{key}_ms": v for p, v in dist.percentiles.items()})
    return out


def write_json(path: str | Path, runs: Sequence[dict[str, Any]]) -> None:
    """One run: vLLM's flat object. A sweep: {"runs": [one object per rate]}."""
    body: Any = runs[0] if len(runs) == 1 else {"runs": list(runs)}
    Path(path).write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
