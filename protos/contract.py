"""The plain-Python side of the executor contract, shared by both services (no protobuf, no gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
V = TypeVar("V")

BlockMap = list[tuple[int, int]]
"""(source block, destination block) pairs of one swap-out, swap-in or copy."""


def released_before(num_computed: int, window: int, block_size: int) -> int:
    """Sliding-window KV cache groups (Capabilities.kv_window_groups): once a request has computed num_computed
    tokens, its window blocks before this block index are never read again (its next query, at num_computed, sees
    keys from num_computed - window + 1 on). The executor stops holding them after that step; the scheduler may
    then give them to other requests."""
    return max(0, num_computed - window + 1) // block_size


def ring_blocks(window: int, block_size: int) -> int:
    """Sliding-window KV cache groups kept as rings (Capabilities.kv_window_ring): the blocks of one request's
    ring per window group, ceil(window / block_size) + 1: the window of any query and its block's start."""
    return -(-window // block_size) + 1


def ring_table(ring: Sequence[int], num_positions: int, block_size: int, ring_size: int) -> list[int]:
    """A ring (up to ring_size blocks) as a table by position: block i of the sequence lives in
    ring[i % ring_size]; covers positions [0, num_positions). The ring must hold every block it names."""
    return [ring[i % ring_size] for i in range(-(-num_positions // block_size))]


def split_columns(values: Sequence[T], counts: Sequence[int]) -> list[list[T]]:
    """Cut a flat column into consecutive runs of counts[i] values (RunningRequests.new_block_ids by
    num_new_blocks, SampledTokens.token_ids by num_tokens). The counts must add up to len(values)."""
    values = list(values)  # slicing a list is much cheaper than slicing a protobuf repeated field
    out: list[list[T]] = []
    i = 0
    for n in counts:
        out.append(values[i:i + n])
        i += n
    return out


@dataclass(frozen=True, slots=True)
class SamplingParam(Generic[V]):
    """One sampling parameter's default (what an unset proto field means) and allowed range."""

    default: V
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    rule: str = ""  # how a refusal states the range, where the bounds alone do not say it

    def allows(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def describe(self, high: float | None = None) -> str:
        """The range as refusals state it; `high` replaces a bound known only at run time."""
        if self.rule:
            return self.rule
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high if high is None else high}]"


@dataclass(frozen=True, slots=True)
class SamplingTable:
    """vLLM's sampling parameters: the one table that validation, the scheduler core and the executor
    read their defaults and ranges from (common.proto's SamplingParams carries them)."""

    max_tokens: SamplingParam[int] = SamplingParam(16, low=1, rule=">= 1")
    min_tokens: SamplingParam[int] = SamplingParam(0, low=0)
    temperature: SamplingParam[float] = SamplingParam(1.0, low=0, rule=">= 0")  # 0 = greedy
    top_p: SamplingParam[float] = SamplingParam(1.0, low=0, high=1, low_open=True)
    top_k: SamplingParam[int] = SamplingParam(-1, low=-1, rule="-1 (off), 0 (off) or positive")
    min_p: SamplingParam[float] = SamplingParam(0.0, low=0, high=1)
    presence_penalty: SamplingParam[float] = SamplingParam(0.0, low=-2, high=2)
    frequency_penalty: SamplingParam[float] = SamplingParam(0.0, low=-2, high=2)
    repetition_penalty: SamplingParam[float] = SamplingParam(1.0, low=0, high=2, low_open=True)
    logprobs: SamplingParam[int | None] = SamplingParam(None, low=0)  # high: the server's --max-logprobs
    prompt_logprobs: SamplingParam[int | None] = SamplingParam(None, low=0)  # high: as logprobs
    n: SamplingParam[int] = SamplingParam(1, low=1, high=16)
    seed: SamplingParam[int | None] = SamplingParam(None)
    priority: SamplingParam[int] = SamplingParam(0)
    logit_bias: SamplingParam[float] = SamplingParam(0.0, low=-100, high=100)  # each bias; ids < vocab_size


SAMPLING = SamplingTable()


@dataclass(slots=True, frozen=True)
class SamplingConfig:
    """The parameters that shape a request's next-token distribution: what the executor's sampler reads.
    The scheduler's SamplingOptions extends them with what only the scheduler needs (lengths, stops).

    min_tokens and stop_token_ids shape it too: until min_tokens tokens are out, the executor masks the
    stop_token_ids and its own EOS ids (vLLM's min_tokens rule, ignore_eos or not)."""

    temperature: float = SAMPLING.temperature.default
    top_p: float = SAMPLING.top_p.default
    top_k: int = SAMPLING.top_k.default
    min_p: float = SAMPLING.min_p.default
    seed: int | None = SAMPLING.seed.default
    presence_penalty: float = SAMPLING.presence_penalty.default
    frequency_penalty: float = SAMPLING.frequency_penalty.default
    repetition_penalty: float = SAMPLING.repetition_penalty.default
    logprobs: int | None = SAMPLING.logprobs.default
    min_tokens: int = SAMPLING.min_tokens.default
    stop_token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits after the penalties
    prompt_logprobs: int | None = SAMPLING.prompt_logprobs.default  # top alternatives per prompt position; None: none

    def masked_ids(self, num_output: int, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The token ids a request may not sample after num_output tokens of its own: its stop tokens and the
        model's EOS ids while num_output < min_tokens (vLLM's min_tokens), none after."""
        if num_output >= self.min_tokens:
            return ()
        return (*eos_token_ids, *self.stop_token_ids)


def prompt_logprob_positions(start: int, num_tokens: int, num_prompt_tokens: int) -> range:
    """The prompt positions whose logprobs a pass computing positions [start, start + num_tokens) yields: the
    row of position p predicts token p + 1, so p + 1 in [start + 1, min(start + num_tokens, num_prompt_tokens - 1)]
    (position 0 has none; the row of the prompt's last token predicts the first output, not a prompt token)."""
    return range(start + 1, min(start + num_tokens, num_prompt_tokens - 1) + 1)
