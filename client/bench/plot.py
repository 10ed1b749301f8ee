"""PNG of a benchmark: latency (mean, median, percentiles) and throughput, one point per request rate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from client.bench.stats import BenchMetrics, Distribution, percentile_label

LATENCY_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


@dataclass(frozen=True, slots=True)
class PlotPoint:
    label: str              # the request rate, as shown on the x axis
    metrics: BenchMetrics


def latency_series(dists: Sequence[Distribution]) -> dict[str, list[float]]:
    series = {"mean": [d.mean for d in dists], "median": [d.median for d in dists]}
    for p in dists[0].percentiles:
        if p == 50:
            continue  # the median already
        series[percentile_label(p)] = [d.percentiles[p] for d in dists]
    return series


def plot_results(points: Sequence[PlotPoint], path: str | Path, title: str = "pagedserve serving benchmark") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(points)))
    labels = [p.label for p in points]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5), constrained_layout=True)
    for ax, (key, name) in zip(axes.flat, LATENCY_PANELS, strict=False):
        for label, ys in latency_series([getattr(p.metrics, key) for p in points]).items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_title(f"{name} (ms)")
        ax.set_ylabel("ms")
    tokens, requests = axes.flat[4], axes.flat[5]
    tokens.plot(xs, [p.metrics.output_throughput for p in points], marker="o", label="output tok/s")
    tokens.plot(xs, [p.metrics.total_token_throughput for p in points], marker="o", label="total tok/s")
    tokens.set_title("token throughput (tok/s)")
    requests.plot(xs, [p.metrics.request_throughput for p in points], marker="o", label="completed req/s")
    if all(p.metrics.request_goodput is not None for p in points):
        requests.plot(xs, [p.metrics.request_goodput or 0.0 for p in points], marker="o", label="goodput req/s")
    requests.set_title("request throughput (req/s)")
    for ax in axes.flat:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
