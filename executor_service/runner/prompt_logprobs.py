"""Prompt logprobs in the torch backend (SamplingParams.prompt_logprobs): only the items that ask pay for them.

The forward pass keeps the final hidden states of their prompt rows beside the rows it samples (the row of
position p predicts token p + 1). Their logits are never materialised at once: prompt_row_logprobs turns at most
LOGIT_ELEMENTS logits into log_softmax at a time (the rows of a 2,048-token prompt chunk on a 151,936-token
vocabulary were 1.2 GB of float32 logits and as much again of logprobs), keeping only the prompt token's logprob and
the top k of each row. Under tensor parallelism every rank runs it in step (each chunk's logits are gathered from
every rank). Each asking item then gets its answer in BatchItem.prompt_out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from executor_service.backend import BatchItem, PromptLogprobs, SampleOutput

LOGIT_ELEMENTS = 1 << 24
"""Logits turned into logprobs at a time: 64 MiB of float32 (110 rows of a 151,936-token vocabulary)."""


@dataclass(slots=True)
class PromptRowLogprobs:
    """Per prompt row: the logprob of the prompt token it predicts, and its top k (logprob, token id) pairs."""

    chosen: list[float] = field(default_factory=list)
    top_values: list[list[float]] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)


def prompt_rows(items: Sequence[BatchItem]) -> list[int]:
    """The packed batch's rows whose logits give the items' prompt logprobs, item by item (the rows of positions
    p - 1 for each p of BatchItem.prompt_positions())."""
    rows: list[int] = []
    offset = 0
    for item in items:
        positions = item.prompt_positions()
        if positions:
            first = offset + positions.start - 1 - item.start
            rows.extend(range(first, first + len(positions)))
        offset += item.num_tokens
    return rows


def prompt_targets(items: Sequence[BatchItem]) -> list[int]:
    """The prompt tokens the rows of prompt_rows(items) predict, in order."""
    return [item.token_ids[p] for item in items for p in item.prompt_positions()]


def prompt_top_k(items: Sequence[BatchItem], vocab_size: int) -> int:
    """The most alternatives an asking item wants (each keeps its own number of them)."""
    return min(max((item.sampling.prompt_logprobs or 0 for item in items if item.prompt_positions()), default=0),
               vocab_size)


def prompt_row_logprobs(hidden: Tensor, targets: Sequence[int], k: int, vocab_size: int,
                        compute_logits: Callable[[Tensor], Tensor]) -> PromptRowLogprobs:
    """The prompt rows' logprobs from their final hidden states, at most LOGIT_ELEMENTS logits at a time."""
    out = PromptRowLogprobs()
    rows = max(1, LOGIT_ELEMENTS // max(1, vocab_size))
    index = torch.tensor(list(targets), dtype=torch.long, device=hidden.device)
    for start in range(0, hidden.shape[0], rows):
        logprobs = torch.log_softmax(compute_logits(hidden[start:start + rows]).float(), dim=-1)
        out.chosen += logprobs.gather(1, index[start:start + rows, None]).squeeze(1).tolist()
        if k:
            values, ids = logprobs.topk(k, dim=-1)
            out.top_values += values.tolist()
            out.top_ids += ids.tolist()
        del logprobs
    return out


def fill_prompt_logprobs(result: PromptRowLogprobs, items: Sequence[BatchItem]) -> None:
    """Set prompt_out on each item that asks, from the rows prompt_row_logprobs computed (prompt_rows' order)."""
    targets = prompt_targets(items)
    at = 0
    for item in items:
        positions = item.prompt_positions()
        if not positions:
            continue
        n = item.sampling.prompt_logprobs or 0
        tokens = [SampleOutput(targets[at + j], result.chosen[at + j],
                               list(zip(result.top_ids[at + j][:n], result.top_values[at + j][:n], strict=True))
                               if n else [])
                  for j in range(len(positions))]
        item.prompt_out = PromptLogprobs(positions.start, tokens)
        at += len(positions)
