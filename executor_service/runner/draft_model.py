"""Speculative decoding with a draft model (executor --draft-model DIR): a second, usually smaller model with the
target's tokenizer, run beside it over its own paged KV cache -- the same block size and block count, so a
request's block table indexes both, and swaps and copies move both.

At a step where a request carries num_model_drafts = k, the draft model first catches up on the positions its KV
lacks ([draft_start, the request's last token]: after a prefill, a plain decode, or a run whose every draft was
accepted), which proposes the first draft, then decodes k - 1 more greedily, one position per pass, writing its
KV into the lookahead slots that the scheduler reserved for the drafts. The target then verifies the drafts in
its one pass (runner/speculative.py). The draft model's KV is right wherever it was fed accepted tokens; the
executor's RequestState.draft_computed says how far (server.py), and a position it wrote for a rejected draft
is written again before the draft model attends to it. Only acceptance depends on the draft model, never the
output: every token is the target's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from executor_service.backend import BatchItem
from executor_service.model import LlamaForCausalLM, ModelConfig
from executor_service.runner.kv_cache import KVCache
from protos.contract import BlockMap

BuildBatch = Callable[[list[BatchItem]], Any]
"""The backend's packing of items into a batch (input_ids, positions, meta, output_rows)."""


class DraftModelError(ValueError):
    """A --draft-model that cannot draft for this model; the message names the flag and the field."""


def check_draft_vocabulary(draft_dir: Path, draft_cfg: ModelConfig, target_dir: Path, target_cfg: ModelConfig) -> None:
    """The draft model must share the target's tokenizer: the same vocab_size and, where both directories have
    one, the same tokenizer.json."""
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise DraftModelError(f"--draft-model {draft_dir}: vocab_size {draft_cfg.vocab_size} differs from the "
                              f"model's {target_cfg.vocab_size}; a draft model must share the model's tokenizer")
    mine, theirs = draft_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if mine.is_file() and theirs.is_file() and mine.read_bytes() != theirs.read_bytes():
        raise DraftModelError(f"--draft-model {draft_dir}: tokenizer.json differs from the model's; a draft model "
                              "must share the model's tokenizer")


class DraftModel:
    """The draft model, its KV cache, and the greedy proposals of one step."""

    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache, build: BuildBatch) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.build = build

    def swap_out(self, mapping: BlockMap) -> None:
        self.kv_cache.swap_out(mapping)

    def swap_in(self, mapping: BlockMap) -> None:
        self.kv_cache.swap_in(mapping)

    def copy(self, mapping: BlockMap) -> None:
        self.kv_cache.copy(mapping)

    def propose(self, items: Sequence[BatchItem]) -> list[BatchItem]:
        """The items, each one with num_model_drafts carrying its proposed tokens as draft_token_ids instead."""
        chosen = [i for i, item in enumerate(items) if item.num_model_drafts and item.sample]
        if not chosen:
            return list(items)
        drafts: list[list[int]] = [[] for _ in chosen]
        passes = [self._catch_up(items[i]) for i in chosen]
        for pass_no in range(max(items[i].num_model_drafts for i in chosen)):
            active = [j for j, i in enumerate(chosen) if pass_no < items[i].num_model_drafts]
            if pass_no:
                passes = [self._next(items[chosen[j]], drafts[j]) for j in active]
            for j, token in zip(active, self._greedy(passes), strict=True):
                drafts[j].append(token)
        out = list(items)
        for j, i in enumerate(chosen):
            out[i] = replace(items[i], draft_token_ids=tuple(drafts[j]), num_model_drafts=0)
        return out

    @staticmethod
    def _catch_up(item: BatchItem) -> BatchItem:
        """Positions [draft_start, last token]: what the draft model's KV lacks, and the first proposal."""
        end = item.start + item.num_tokens
        start = min(item.draft_start, item.start)
        return replace(item, start=start, num_tokens=end - start, draft_token_ids=(), num_model_drafts=0,
                       token_mask=None, deferred_masks=None)

    @staticmethod
    def _next(item: BatchItem, drafts: list[int]) -> BatchItem:
        """One more position: the last draft as input, at its own position."""
        tokens = [*item.token_ids, *drafts]
        return replace(item, token_ids=tokens, start=len(tokens) - 1, num_tokens=1, draft_token_ids=(),
                       num_model_drafts=0, token_mask=None, deferred_masks=None)

    def _greedy(self, items: list[BatchItem]) -> list[int]:
        """One forward pass of the draft model over the items; the argmax after each item's last position."""
        batch = self.build(items)
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers, batch.output_rows)
        return [int(t) for t in self.model.compute_logits(hidden).argmax(dim=-1).tolist()]
