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

from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import overload

import torch
from torch import Tensor

from executor_service.backend import BatchItem, SampleOutput
from executor_service.runner.sampler import SampleRequest

ITEM_FIELDS = tuple(f.name for f in fields(BatchItem))


def expand_drafts(items: Sequence[BatchItem]) -> list[BatchItem]:
    """The items as the pass computes them: each one's drafts appended to its known tokens and computed."""
    return [with_drafts_computed(item) if item.draft_token_ids else item for item in items]


def with_drafts_computed(item: BatchItem) -> BatchItem:
    """A copy of the item whose drafts are known tokens it computes (field by field: dataclasses.replace runs
    __init__ through keyword arguments, ~5 us an item, the most of a batch-64 verification's bookkeeping)."""
    expanded = object.__new__(BatchItem)
    for name in ITEM_FIELDS:
        setattr(expanded, name, getattr(item, name))
    expanded.token_ids = [*item.token_ids, *item.draft_token_ids]
    expanded.num_tokens = item.num_tokens + len(item.draft_token_ids)
    expanded.draft_token_ids = ()
    return expanded


class DraftContext(Sequence[int]):
    """A verified row's context without copying it: the item's known tokens, then its first `used` drafts (the
    sampler reads it only for penalties; building k + 1 lists of a long context per item cost more than the
    verification's sampling at batch 64)."""

    __slots__ = ("drafts", "known", "used")

    def __init__(self, known: Sequence[int], drafts: Sequence[int], used: int) -> None:
        self.known, self.drafts, self.used = known, drafts, used

    def __len__(self) -> int:
        return len(self.known) + self.used

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        known = len(self.known)
        return self.known[index] if index < known else self.drafts[index - known]

    def __iter__(self) -> Iterator[int]:
        yield from self.known
        yield from self.drafts[:self.used]


def verify_rows(items: Sequence[BatchItem], sample_items: Sequence[int]) -> list[int]:
    """The pass's rows to sample (flat indices into its tokens): the last k + 1 rows of every sampled item with
    k drafts."""
    ends: list[int] = []
    total = 0
    for item in items:
        total += item.num_tokens + len(item.draft_token_ids)
        ends.append(total)
    rows: list[int] = []
    for i in sample_items:
        count = len(items[i].draft_token_ids) + 1
        rows.extend(range(ends[i] - count, ends[i]))
    return rows


def verify_requests(items: Sequence[BatchItem], sample_items: Sequence[int]) -> list[SampleRequest]:
    """What each of verify_rows' rows samples: each at its own position with the drafts before it as context
    (built after resolve_masks: an item's mask may come after the pass)."""
    requests: list[SampleRequest] = []
    for i in sample_items:
        item = items[i]
        drafts, known = item.draft_token_ids, len(item.token_ids)
        requests.append(SampleRequest(item.sampling, item.token_ids, item.num_prompt_tokens, known, item.token_mask))
        # (a masked item has no drafts: the scheduler sends none)
        requests.extend(SampleRequest(item.sampling, DraftContext(item.token_ids, drafts, j), item.num_prompt_tokens,
                                      known + j) for j in range(1, len(drafts) + 1))
    return requests


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
