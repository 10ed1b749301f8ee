"""A token's log-probability as the scheduler hands it on: sampled, or a prompt position's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the top alternatives (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


PromptChunk = tuple[int, list[TokenLogprob]]
"""(first position, entries) of one step's prompt-logprob answer for one request."""
