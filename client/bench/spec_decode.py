"""Speculative-decoding figures for `python -m client bench --speculative`: the server's spec-decode counters
(vLLM's names) scraped from its Prometheus endpoint before and after a run, and their difference reported as
`vllm bench serve` does: acceptance rate, acceptance length (tokens per verified step) and per-position
acceptance."""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class MetricsError(RuntimeError):
    """The metrics endpoint cannot be read, or it has no spec-decode counters; the message says which."""


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """The server's spec-decode totals at one moment (or the difference of two)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def minus(self, before: SpecCounters) -> SpecCounters:
        width = max(len(self.per_position), len(before.per_position))
        mine = [*self.per_position, *[0.0] * (width - len(self.per_position))]
        theirs = [*before.per_position, *[0.0] * (width - len(before.per_position))]
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, tuple(a - b for a, b in zip(mine, theirs, strict=True)))


def parse_spec_counters(text: str) -> SpecCounters:
    """The spec-decode counters of a Prometheus text page (summed over label values other than position);
    MetricsError when the page has none (speculation is not configured on that server)."""
    totals = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    positions: dict[int, float] = {}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name in totals and sample.name.endswith("_total"):
                totals[name] += sample.value
                seen = True
            elif name == PER_POS and sample.name.endswith("_total") and "position" in sample.labels:
                position = int(sample.labels["position"])
                positions[position] = positions.get(position, 0.0) + sample.value
    if not seen:
        raise MetricsError(f"the server exports no {DRAFTS}_total: is it running with --speculative-config?")
    width = max(positions) + 1 if positions else 0
    return SpecCounters(totals[DRAFTS], totals[DRAFT_TOKENS], totals[ACCEPTED],
                        tuple(positions.get(i, 0.0) for i in range(width)))


def scrape_spec_counters(url: str, timeout: float = 10.0) -> SpecCounters:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return parse_spec_counters(response.read().decode())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MetricsError(f"--metrics-url {url}: {e}") from None


def spec_summary(delta: SpecCounters) -> dict[str, float | list[float] | None]:
    """vLLM bench serve's keys: acceptance rate in percent, acceptance length (1 + accepted per draft), the
    counts, and per position the share of drafts whose token at that position was accepted."""
    drafts = delta.drafts
    return {
        "spec_decode_acceptance_rate": 100.0 * delta.accepted / delta.draft_tokens if delta.draft_tokens else None,
        "spec_decode_acceptance_length": 1.0 + delta.accepted / drafts if drafts else None,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": delta.draft_tokens,
        "spec_decode_accepted_tokens": delta.accepted,
        "spec_decode_per_position_acceptance_rates": [100.0 * n / drafts for n in delta.per_position]
        if drafts else [],
    }


def format_spec_table(summary: dict[str, float | list[float] | None], width: int = 50) -> str:
    def row(name: str, value: object) -> str:
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40} {shown:<10}"

    lines = [f"{' Speculative Decoding ':-^{width}}",
             row("Acceptance rate (%):", summary["spec_decode_acceptance_rate"]),
             row("Acceptance length:", summary["spec_decode_acceptance_length"]),
             row("Drafts:", int(summary["spec_decode_num_drafts"] or 0)),  # type: ignore[arg-type]
             row("Draft tokens:", int(summary["spec_decode_draft_tokens"] or 0)),  # type: ignore[arg-type]
             row("Accepted tokens:", int(summary["spec_decode_accepted_tokens"] or 0))]  # type: ignore[arg-type]
    rates = summary["spec_decode_per_position_acceptance_rates"]
    if isinstance(rates, list) and rates:
        lines.append("Per-position acceptance (%):")
        lines += [row(f"  Position {i}:", rate) for i, rate in enumerate(rates)]
    return "\n".join(lines)
