"""Prompt logprobs in the torch backend (SamplingParams.prompt_logprobs): only the items that ask pay for them.

The forward pass keeps the final hidden states of their prompt rows beside the rows it samples (the row of
position p predicts token p + 1), the logits of those rows follow the sampled rows' logits, and each such item
gets its answer in BatchItem.prompt_out: the raw log_softmax at the prompt token and the top alternatives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from executor_service.backend import BatchItem, PromptLogprobs, SampleOutput


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


def fill_prompt_logprobs(logits: Tensor, items: Sequence[BatchItem]) -> None:
    """Set prompt_out on each item that asks, from `logits` (float32, the rows prompt_rows(items) named, in order)."""
    asking = [item for item in items if item.prompt_positions()]
    targets = [item.token_ids[p] for item in asking for p in item.prompt_positions()]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    k = min(max(item.sampling.prompt_logprobs or 0 for item in asking), logprobs.shape[1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    at = 0
    for item in asking:
        positions = item.prompt_positions()
        n = item.sampling.prompt_logprobs or 0
        tokens = [SampleOutput(targets[at + j], chosen[at + j],
                               list(zip(top_ids[at + j][:n], top_values[at + j][:n], strict=True)) if n else [])
                  for j in range(len(positions))]
        item.prompt_out = PromptLogprobs(positions.start, tokens)
        at += len(positions)
