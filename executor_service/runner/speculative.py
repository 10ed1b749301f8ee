"""Verification of draft tokens (speculative decoding) in the torch backend's one forward pass.

An item with k drafts computes its scheduled tokens and the k drafts; the logits of its last k + 1 rows are
sampled as the sampler would sample those positions one step at a time (row j sees the drafts before it as
context, and its seeded noise is that of its position), and the drafts are accepted while each equals the
token sampled at its position. Greedy rows thus give exactly the tokens of decoding without drafts, and a
sampled row's token at every position is drawn from the target distribution: for a one-hot (n-gram) draft
d this accepts d with probability p(d) and otherwise draws from p without d, renormalised, which is the
rejection sampler of speculative decoding for such drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from executor_service.backend import BatchItem, SampleOutput
from executor_service.runner.sampler import SampleRequest


def expand_drafts(items: Sequence[BatchItem]) -> list[BatchItem]:
    """The items as the pass computes them: each one's drafts appended to its known tokens and computed."""
    return [replace(item, token_ids=[*item.token_ids, *item.draft_token_ids],
                    num_tokens=item.num_tokens + len(item.draft_token_ids), draft_token_ids=())
            if item.draft_token_ids else item for item in items]


def verify_rows(items: Sequence[BatchItem], sample_items: Sequence[int]) -> tuple[list[int], list[SampleRequest]]:
    """The pass's rows to sample (flat indices into its tokens) and what each samples: the last k + 1 rows of
    every sampled item with k drafts, each at its own position with the drafts before it as context."""
    ends: list[int] = []
    total = 0
    for item in items:
        total += item.num_tokens + len(item.draft_token_ids)
        ends.append(total)
    rows: list[int] = []
    requests: list[SampleRequest] = []
    for i in sample_items:
        item = items[i]
        drafts = list(item.draft_token_ids)
        count = len(drafts) + 1
        rows.extend(range(ends[i] - count, ends[i]))
        known = len(item.token_ids)
        for j in range(count):
            context = [*item.token_ids, *drafts[:j]] if j else item.token_ids
            mask = item.token_mask if j == 0 else None  # (a masked item has no drafts: the scheduler sends none)
            requests.append(SampleRequest(item.sampling, context, item.num_prompt_tokens, known + j, mask))
    return rows, requests


def accept_runs(items: Sequence[BatchItem], sample_items: Sequence[int],
                samples: Sequence[SampleOutput]) -> list[SampleOutput | None]:
    """Per item: None where it does not sample, else its first token with the rest of its run in `extra`: the
    drafts accepted while each equals the token sampled at its position, then the first token that differs (or
    the token after the last draft)."""
    results: list[SampleOutput | None] = [None] * len(items)
    at = 0
    for i in sample_items:
        drafts = items[i].draft_token_ids
        run = [samples[at]]
        while len(run) <= len(drafts) and run[-1].token_id == drafts[len(run) - 1]:
            run.append(samples[at + len(run)])
        at += len(drafts) + 1
        first = run[0]
        first.extra = run[1:]
        results[i] = first
    return results


def row_index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)
