"""The plain-Python side of the executor contract, shared by both services (no protobuf, no gRPC)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

BlockMap = list[tuple[int, int]]
"""(source block, destination block) pairs of one swap-out, swap-in or copy."""


def split_columns(values: Sequence[T], counts: Sequence[int]) -> list[list[T]]:
    """Cut a flat column into consecutive runs of counts[i] values (RunningRequests.new_block_ids by
    num_new_blocks, SampledTokens.token_ids by num_tokens). The counts must add up to len(values)."""
    out: list[list[T]] = []
    i = 0
    for n in counts:
        out.append(list(values[i:i + n]))
        i += n
    return out
