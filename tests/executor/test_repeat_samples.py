"""The copy warm-up's rows (a random segment repeated, loss on the repeats only), the corpus stage's mix of them,
the n-gram best-case score, and the probed training run that stops when copying stops improving."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from executor_service.default_model import model as dm
from executor_service.default_model import training
from executor_service.default_model.copy_check import (
    ngram_tokens_per_step,
    probe_copying,
    quote_fidelity,
    quote_passages,
    quote_prompt,
)
from executor_service.default_model.repeat_samples import IGNORE, RepeatSpec, corpus_vocab, repeat_batch, repeat_row
from executor_service.default_model.training import TrainConfig, corpus_batch, load_sources

SPEC = RepeatSpec(vocab=torch.arange(10, 60), separator=(7, 8), bos=1, min_len=4, max_len=30)
TINY = replace(dm.TRAINED_SPEC, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)


def test_a_repeat_row_is_bos_a_segment_and_its_copies_with_loss_on_the_copies_only() -> None:
    row = repeat_row(SPEC, 10, 64, torch.Generator().manual_seed(0))
    inputs, targets = row.inputs.tolist(), row.targets.tolist()
    assert len(inputs) == len(targets) == 64 and inputs[0] == 1
    segment = inputs[1:11]
    assert all(10 <= t < 60 for t in segment)
    tokens = inputs + targets[-1:]
    assert tokens[11:] == ([7, 8, *segment] * 6)[: 65 - 11]
    assert targets[:10] == [IGNORE] * 10
    assert targets[10:] == tokens[11:]


def test_repeat_batches_are_reproducible_and_keep_two_copies_in_a_row() -> None:
    first = repeat_batch(SPEC, 16, 40, torch.Generator().manual_seed(5))
    again = repeat_batch(SPEC, 16, 40, torch.Generator().manual_seed(5))
    assert torch.equal(first.inputs, again.inputs) and torch.equal(first.targets, again.targets)
    assert first.inputs.shape == first.targets.shape == (16, 40)
    ignored = (first.targets == IGNORE).sum(dim=1).tolist()
    assert all(SPEC.min_len <= n <= 20 for n in ignored)  # segment length capped at half the row
    assert len(set(ignored)) > 1
    assert not torch.equal(first.inputs, repeat_batch(SPEC, 16, 40, torch.Generator().manual_seed(6)).inputs)


def test_the_segment_vocabulary_is_the_streams_tokens_without_specials() -> None:
    stream = torch.tensor([1, 5, 9, 2, 1, 9, 4, 2])
    assert corpus_vocab(stream, (1, 2)).tolist() == [4, 5, 9]


def test_the_corpus_stage_mixes_in_repeat_rows_by_their_share() -> None:
    cfg = TrainConfig(batch_size=32, seq_len=64, copy_fraction=0.5, repeat_fraction=0.5)
    sources = load_sources(dm.train_tokenizer(), dm.read_corpus(), cfg)
    batch = corpus_batch(sources, cfg, torch.Generator().manual_seed(0))
    repeats = (batch.targets == IGNORE).any(dim=1)
    assert 4 <= int(repeats.sum()) <= 28
    plain = batch.targets[~repeats]
    assert torch.equal(batch.inputs[~repeats][:, 1:], plain[:, :-1])  # the corpus rows: targets are next tokens
    none = corpus_batch(sources, replace(cfg, repeat_fraction=0.0), torch.Generator().manual_seed(0))
    assert not (none.targets == IGNORE).any()


def test_the_ngram_best_case_counts_accepted_copies() -> None:
    passage = list(range(100, 140))
    prompt = [*passage, 7, *passage[:10]]
    assert ngram_tokens_per_step(prompt, passage[10:], 4) > 4.0  # a whole quote: ~k + 1 per step
    assert ngram_tokens_per_step(prompt, list(range(200, 230)), 4) == 1.0  # nothing copied
    assert ngram_tokens_per_step(prompt, [], 4) == 0.0


def test_quote_fidelity_counts_the_reproduced_quote_not_repetition() -> None:
    expected = list(range(100, 140))
    assert quote_fidelity(expected, expected) == 1.0
    assert quote_fidelity([*expected[:10], 5, *expected[11:]], expected) == 39 / 40  # one slip costs one token
    assert quote_fidelity([7] * 40, expected) == 0.0  # a loop: n-gram drafts accepted, nothing quoted
    assert quote_fidelity([], expected) == 0.0


def test_quote_prompts_repeat_the_first_third_of_the_benchmark_passages() -> None:
    passages = quote_passages(dm.read_corpus(), 4)
    assert len(passages) == 4 and all(300 <= len(p) <= 900 for p in passages)
    words = passages[0].split(" ")
    assert quote_prompt(passages[0]) == passages[0] + "\n\n" + " ".join(words[: len(words) // 3])


def test_a_probed_run_stops_when_copying_stops_improving(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the real probe at a quarter of its prompts and answer length (8 x 96 greedy tokens in transformers, four
    # times, were ~90% of the test's time): what is checked is when the run probes and stops, and what it keeps
    monkeypatch.setattr(training, "probe_copying", partial(probe_copying, prompts=2, output_len=24))
    cfg = TrainConfig(steps=8, batch_size=2, seq_len=64, warmup=1, log_every=1, repeat_steps=2, repeat_max_len=16,
                      repeat_fraction=0.5, probe_every=1, probe_patience=2, probe_min_gain=100.0)
    training.train(tmp_path / "m", cfg, TINY)
    log = json.loads((tmp_path / "m" / training.TRAINING_LOG).read_text())
    assert log["steps_run"] == 2 + 2  # the warm-up's two steps, then two probes without the (impossible) gain
    assert [probe[0] for probe in log["probes"]] == [1, 2, 3, 4]
    assert log["best"] == max(fidelity for _, _, fidelity in log["probes"][2:])
    assert (tmp_path / "m" / "model.safetensors").is_file()
