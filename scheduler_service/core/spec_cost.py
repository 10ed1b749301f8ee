"""Speculation by measurement: what a draft token costs against what an accepted one saves, per batch size.

The executor reports its time in every step (ExecutorResult.busy_s). From decode steps the scheduler learns, per
batch size (exact up to 8, then per power of two), the seconds per row of a plain step (token_s: what one more
output token is worth at that batch) and the marginal seconds of one draft token in a verification (draft_s: the
verification's time beyond the plain step of its batch, per draft). Under async scheduling a verification also
costs the scheduler's turnaround once (the step after it waits for its answer instead of overlapping): turnaround_s
per batch size, measured as a lone step's round trip less the executor's time.

A request with k drafts whose verifications accept `gain` tokens on average adds gain * token_s - k * draft_s
seconds of value to a step: its expected tokens per step (1 + gain) beat the cost ratio of its verification,
(token_s + k * draft_s) / token_s. It speculates while that is positive, and starts again only once it clears a
margin (hysteresis); while off, its n-gram proposals are still scored against the tokens that come (shadow
drafts), so it comes back when its text starts to repeat. A step carries drafts only if their summed value pays
for the turnaround. Where even a fully accepted draft costs more than a plain token (token_s <= draft_s) nothing
is proposed at all, and a stale measurement is refreshed by a probe: one plain step, or one request's drafts,
every PROBE_EVERY decode steps of that batch size. Before the executor has reported any time, speculation is on.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

ALPHA = 0.25  # weight of the newest measurement in the moving averages
PROBE_EVERY = 32  # decode steps of a batch size after which its plain or draft cost is measured again
ON_MARGIN = 1.25  # a request that is off speculates again once its value clears this factor of its cost


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


def batch_key(batch: int) -> int:
    """Exact batch sizes up to 8 (a decode's cost per row falls fast there), then one key per power of two."""
    return batch if batch <= 8 else 8 + (batch - 1).bit_length()


class Probe(enum.Enum):
    NONE = "none"  # both costs known and fresh: decide by value
    PLAIN = "plain"  # this step runs without drafts, to measure a plain step
    DRAFTS = "drafts"  # this step verifies one request's drafts whatever their value, to measure a draft


@dataclass(slots=True)
class BatchCost:
    token_s: float | None = None
    draft_s: float | None = None
    since_plain: int = 0
    since_drafts: int = 0
    turnaround_s: float | None = None


@dataclass(slots=True)
class StepCosts:
    """The measured costs (module docstring); fed by update(), read by _propose()."""

    batches: dict[int, BatchCost] = field(default_factory=dict)
    reporting: bool = False  # the executor reports its step times
    mean_gain: float | None = None  # accepted tokens per verification over all requests: a new request's prior

    def of(self, batch: int) -> BatchCost:
        key = batch_key(batch)
        found = self.batches.get(key)
        if found is None:
            found = self.batches[key] = BatchCost()
        return found

    def observe_step(self, batch: int, drafts: int, busy_s: float) -> None:
        """A decode step of `batch` requests with `drafts` draft tokens in all took busy_s in the executor."""
        if busy_s <= 0.0 or batch < 1:
            return
        self.reporting = True
        cost = self.of(batch)
        if not drafts:
            cost.token_s = ema(cost.token_s, busy_s / batch)
            cost.since_plain = 0
            cost.since_drafts += 1
        elif cost.token_s is not None:
            cost.draft_s = ema(cost.draft_s, max(0.0, busy_s - batch * cost.token_s) / drafts)
            cost.since_drafts = 0
            cost.since_plain += 1

    def observe_turnaround(self, batch: int, round_trip_s: float, busy_s: float) -> None:
        """A step of `batch` requests scheduled with nothing in flight came back after round_trip_s, busy_s of it
        in the executor (the scheduler's own share grows with the batch: one average per batch size)."""
        if busy_s > 0.0 and batch >= 1:
            cost = self.of(batch)
            cost.turnaround_s = ema(cost.turnaround_s, max(0.0, round_trip_s - busy_s))

    def turnaround_s(self, batch: int) -> float:
        """The turnaround a verification adds under async scheduling at this batch size (0 until measured)."""
        return self.of(batch).turnaround_s or 0.0

    def observe_gain(self, accepted: int) -> None:
        self.mean_gain = ema(self.mean_gain, float(accepted))

    def probe(self, batch: int) -> Probe:
        cost = self.of(batch)
        if not self.reporting:
            return Probe.NONE
        if cost.token_s is None or cost.since_plain >= PROBE_EVERY:
            return Probe.PLAIN
        if cost.draft_s is None or cost.since_drafts >= PROBE_EVERY:
            return Probe.DRAFTS
        return Probe.NONE

    def pays_at_all(self, batch: int) -> bool:
        """Whether a fully accepted draft can be worth its cost at this batch size (or it is not known yet)."""
        cost = self.of(batch)
        return cost.token_s is None or cost.draft_s is None or cost.token_s > cost.draft_s

    def value_s(self, batch: int, gain: float, drafts: int) -> float:
        """Seconds a request's `drafts` drafts, accepting `gain` on average, save its step (positive: worth it);
        +inf while either cost is unknown."""
        cost = self.of(batch)
        if cost.token_s is None or cost.draft_s is None:
            return float("inf")
        return gain * cost.token_s - drafts * cost.draft_s

    def clears(self, batch: int, gain: float, drafts: int, was_on: bool) -> bool:
        """The per-request decision with hysteresis: on while its value is positive; back on once its saving clears
        ON_MARGIN times its cost."""
        cost = self.of(batch)
        if cost.token_s is None or cost.draft_s is None:
            return True
        saving, spend = gain * cost.token_s, drafts * cost.draft_s
        return saving > spend if was_on else saving > ON_MARGIN * spend
