"""Speculative decoding on the scheduler's side: the configuration (vLLM's --speculative-config), the n-gram
proposer and the per-request back-off that keeps speculation off where its drafts are rejected.

The n-gram proposer is model-free: it looks for the latest earlier occurrence of a request's last n tokens
(n from prompt_lookup_max down to prompt_lookup_min) and proposes the tokens that followed it. The executor
verifies the drafts in one forward pass and returns 1 to k+1 tokens (docs/speculative.md).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from scheduler_service.core.spec_cost import ema

MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 1 << 20  # never, as vLLM's default: the measured costs decide (spec_cost.py)


class SpecMethod(enum.Enum):
    NGRAM = "ngram"
    DRAFT_MODEL = "draft_model"  # proposed by the executor's draft model (executor --draft-model DIR)


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """vLLM's speculative-config keys (method, num_speculative_tokens, prompt_lookup_min/max,
    disable_by_batch_size: a hard cap above the measured decision of spec_cost.py) and our per-request back-off
    (min_acceptance_rate: a request whose recent drafts are
    accepted less often than this pauses speculating for a while, longer each time)."""

    method: SpecMethod = SpecMethod.NGRAM
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    min_acceptance_rate: float = 0.2
    model: str | None = None
    """draft_model: the draft model directory as the executor's --draft-model names it (informational: the executor
    loads it; the scheduler needs the executor's capability)."""
    adaptive: bool = True
    """Draft only where the measured costs say it pays (spec_cost.py); false: wherever the batch is under
    disable_by_batch_size and the request's acceptance allows (ours: vLLM has no such key)."""


KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size",
        "min_acceptance_rate", "model", "adaptive")


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """The flag's JSON object as a SpeculativeConfig; ValueError naming the key that is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"speculative-config: not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError("speculative-config: must be a JSON object")
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise ValueError(f"speculative-config: unknown key {unknown[0]!r} (known: {', '.join(KEYS)})")
    return build_config(raw)


def build_config(raw: dict[str, Any]) -> SpeculativeConfig:
    name = raw.get("method")
    method = {m.value: m for m in SpecMethod}.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"speculative-config.method: must be 'ngram' or 'draft_model', got {name!r}")
    model = raw.get("model")
    if model is not None and (method is not SpecMethod.DRAFT_MODEL or not isinstance(model, str) or not model):
        raise ValueError("speculative-config.model: a non-empty directory string, with method 'draft_model' only "
                         f"(the executor loads it from its own --draft-model), got {model!r}")
    if "num_speculative_tokens" not in raw:
        raise ValueError("speculative-config.num_speculative_tokens: required")
    k = _int(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    high = _int(raw, "prompt_lookup_max", 1, 64, default=5)
    low = _int(raw, "prompt_lookup_min", 1, high, default=min(2, high))
    batch = _int(raw, "disable_by_batch_size", 1, 1 << 20, default=DEFAULT_DISABLE_BY_BATCH_SIZE)
    rate = raw.get("min_acceptance_rate", 0.2)
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"speculative-config.min_acceptance_rate: must be a number in [0, 1], got {rate!r}")
    adaptive = raw.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ValueError(f"speculative-config.adaptive: must be true or false, got {adaptive!r}")
    return SpeculativeConfig(method, k, low, high, batch, float(rate), model, adaptive)


def _int(raw: dict[str, Any], key: str, low: int, high: int, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative-config.{key}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def propose_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens (the longest n
    in [n_min, n_max] that occurs); a continuation that runs into the end of the sequence repeats itself, as a
    copy would. Empty when no n-gram recurs or k < 1.

    It scans only the earlier occurrences of the last token (list.index runs in C) and extends each match
    backwards: ~10 us on a 300-token request where comparing every window for every n took ~140 us, paid per
    request per step."""
    num = len(tokens)
    if k < 1 or num < n_min + 1:
        return []
    cap = min(n_max, num - 1)
    best_len, best_end = 0, -1
    for end in reversed(occurrences(tokens, tokens[-1], num - 1)):
        length = 1
        while length < cap and length <= end and tokens[end - length] == tokens[num - 1 - length]:
            length += 1
        if length > best_len:  # the latest occurrence wins a tie: candidates come latest first
            best_len, best_end = length, end
            if length == cap:
                break
    if best_len < n_min:
        return []
    return continuation(tokens, best_end + 1, k)


def occurrences(tokens: list[int], token: int, stop: int) -> list[int]:
    """The indices before `stop` where `token` occurs, in order."""
    found: list[int] = []
    at = -1
    while True:
        try:
            at = tokens.index(token, at + 1, stop)
        except ValueError:
            return found
        found.append(at)


def continuation(tokens: list[int], start: int, k: int) -> list[int]:
    """k tokens copied from `start` on, the copy reading its own output past the end of tokens."""
    out = tokens[start:start + k]
    period = len(tokens) - start
    while len(out) < k:
        out.append(out[len(out) - period])
    return out


@dataclass(slots=True)
class DraftRecord:
    """One request's speculation so far: steps verified, draft tokens sent and accepted (for the request log and
    the metrics), and the back-off: a recent acceptance rate, and the output length before which it does not
    propose (paused after its rate fell below the floor), with the length of its last pause. guess: drafts proposed
    but not verified, from a position on (an n-gram proposal while its step was in flight under async scheduling,
    or one that did not pay its verification: a shadow), scored against the tokens that come as a verification
    would have scored them. gain: a recent average of its accepted drafts per verification (shadows included),
    which with the measured costs decides whether it speculates (spec_cost.py); on: its last decision (the
    hysteresis). depth: a recent average of its accepted run (accepted drafts + 1), which caps how many drafts it
    gets (draft_depth): a request whose first drafts are rejected drafts fewer, so a verification or a draft
    model's passes are not spent on positions that are rarely accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    recent: float = 1.0
    resume_at: int = 0
    pause: int = 0
    guess: tuple[int, tuple[int, ...]] | None = None
    depth: float = float(MAX_SPECULATIVE_TOKENS + 1)
    gain: float | None = None
    on: bool = True

    def draft_depth(self, k_max: int) -> int:
        """Drafts to propose now: its recent accepted run (rounded), within [1, k_max]."""
        return max(1, min(k_max, round(self.depth)))

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verified step (accepted drafts plus the model's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0

    def record(self, drafted: int, accepted: int, num_output: int, floor: float) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.score(drafted, accepted, num_output, floor)

    def score(self, drafted: int, accepted: int, num_output: int, floor: float) -> None:
        """A verification's outcome (or a guess's) in the averages that decide its next drafts."""
        self.depth = min(self.depth, drafted + 1.0) * 0.5 + (accepted + 1) * 0.5
        self.gain = ema(self.gain, float(accepted))
        self.observe(accepted / drafted, num_output, floor)

    def settle_guess(self, tokens: list[int], num_output: int, floor: float) -> int | None:
        """Score the guessed drafts once the tokens at their positions are known (or one of them differs): the
        number a verification would have accepted; None while undecided."""
        if self.guess is None:
            return None
        position, drafts = self.guess
        known = tokens[position:position + len(drafts)]
        accepted = next((i for i, (a, b) in enumerate(zip(known, drafts, strict=False)) if a != b), len(known))
        if accepted == len(known) < len(drafts):
            return None
        self.guess = None
        self.score(len(drafts), accepted, num_output, floor)
        return accepted

    def observe(self, rate: float, num_output: int, floor: float) -> None:
        self.recent = 0.6 * self.recent + 0.4 * rate
        if self.recent < floor:
            self.pause = min(64, max(8, 2 * self.pause))
            self.resume_at = num_output + self.pause
            self.recent = 0.5 * (1.0 + floor)


@dataclass(slots=True)
class SpecDecodeStats:
    """Totals since start, with vLLM's metric meanings: drafts (verified steps that carried drafts), draft
    tokens, accepted tokens, and accepted tokens per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if self.accepted_per_pos is None:
            self.accepted_per_pos = []
        per_pos = self.accepted_per_pos
        if len(per_pos) < drafted:
            per_pos.extend([0] * (drafted - len(per_pos)))
        for i in range(accepted):
            per_pos[i] += 1
