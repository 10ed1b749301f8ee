"""The copy model's recipe: copy samples repeat their passage, fine-tuning is deterministic, and the trained
model is cached under its recipe's key (built once, rebuilt only when the recipe changes)."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from executor_service.default_model import model as dm
from executor_service.default_model import training
from executor_service.default_model.copy_samples import SEPARATOR, copy_documents
from executor_service.default_model.repeat_samples import IGNORE
from executor_service.default_model.training import TrainConfig, copy_stream, ensure_trained, recipe_key

TINY = replace(dm.TRAINED_SPEC, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
TINY_COPY = TrainConfig(steps=2, batch_size=2, seq_len=64, warmup=1, log_every=1, copy_fraction=0.5)


def test_copy_documents_repeat_their_passage_and_are_reproducible() -> None:
    docs = ["the cat sat on the mat and looked at the dog for a long time", "a b c d e f g h i j k l m n o p"]
    first = copy_documents(docs, edit_share=0.5, seed=3)
    assert first == copy_documents(docs, edit_share=0.5, seed=3)
    for doc, passage in zip(first, docs, strict=True):
        head, repeat = doc.split(SEPARATOR)
        assert head == passage
        assert len(repeat.split(" ")) == len(passage.split(" "))
    assert copy_documents(docs, edit_share=0.0, seed=3) == [d + SEPARATOR + d for d in docs]


def test_shuffled_passages_keep_their_words_and_are_repeated_verbatim() -> None:
    docs = [" ".join(f"w{i}" for i in range(40))]
    (doc,) = copy_documents(docs, edit_share=0.0, seed=1, shuffle_share=1.0)
    head, repeat = doc.split(SEPARATOR)
    assert head == repeat and head != docs[0]
    assert sorted(head.split(" ")) == sorted(docs[0].split(" "))


def test_copy_rows_start_at_a_document_and_hold_it_whole() -> None:
    tokenizer = dm.train_tokenizer()
    copies = copy_stream(tokenizer, dm.read_corpus(), replace(TINY_COPY, copy_edit_share=0.0))
    assert len(copies.starts) > 10
    sep = tokenizer.encode(SEPARATOR, add_special_tokens=False).ids
    for start in copies.starts[:10].tolist():
        row = copies.tokens[start : start + TINY_COPY.seq_len + 1].tolist()
        assert row[0] == dm.BOS_TOKEN_ID and dm.EOS_TOKEN_ID in row
        text = tokenizer.decode(row[1 : row.index(dm.EOS_TOKEN_ID)])
        head, repeat = text.split(tokenizer.decode(sep))
        assert head.strip() == repeat.strip()


def test_fine_tuning_from_weights_is_deterministic(tmp_path: Path) -> None:
    base = tmp_path / "base"
    training.train(base, replace(TINY_COPY, copy_fraction=0.0), TINY)
    tuned = replace(TINY_COPY, init_from=str(base), repeat_steps=2, repeat_max_len=16, repeat_fraction=0.5)
    training.train(tmp_path / "a", tuned, TINY)
    training.train(tmp_path / "b", tuned, TINY)
    a, b = (tmp_path / "a" / "model.safetensors").read_bytes(), (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a == b
    assert a != (base / "model.safetensors").read_bytes()


def test_the_trained_model_is_cached_under_its_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path))
    built = ensure_trained("copy-test", TINY_COPY, TINY)
    assert built.parent == tmp_path and built.name == f"copy-test-{recipe_key(TINY_COPY, TINY)}"
    assert (built / "model.safetensors").is_file() and (built / "tokenizer.json").is_file()

    def refuse(*_: object) -> float:
        raise AssertionError("a cached recipe was trained again")
    monkeypatch.setattr(training, "train", refuse)
    assert ensure_trained("copy-test", TINY_COPY, TINY) == built
    assert recipe_key(replace(TINY_COPY, steps=3), TINY) != recipe_key(TINY_COPY, TINY)
    assert recipe_key(replace(TINY_COPY, copy_fraction=0.25), TINY) != recipe_key(TINY_COPY, TINY)
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no temporary directory left behind


def test_the_recipe_key_follows_the_start_weights_not_their_path(tmp_path: Path) -> None:
    recipe = training.COPY_RECIPE
    assert recipe.init_from == str(dm.TRAINED_MODEL_DIR) and recipe.copy_fraction > 0
    moved = tmp_path / "moved"
    shutil.copytree(dm.TRAINED_MODEL_DIR, moved)
    assert recipe_key(replace(recipe, init_from=str(moved)), dm.TRAINED_SPEC) == recipe_key(recipe, dm.TRAINED_SPEC)
    weights = moved / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert recipe_key(replace(recipe, init_from=str(moved)), dm.TRAINED_SPEC) != recipe_key(recipe, dm.TRAINED_SPEC)


def test_copy_rows_can_take_their_loss_from_the_repeat_only() -> None:
    cfg = replace(TINY_COPY, batch_size=4, copy_fraction=1.0, copy_edit_share=0.0, copy_repeat_loss_only=True)
    tokenizer = dm.train_tokenizer()
    sources = training.load_sources(tokenizer, dm.read_corpus(), cfg)
    batch = training.corpus_batch(sources, cfg, torch.Generator().manual_seed(0))
    for inputs, targets in zip(batch.inputs.tolist(), batch.targets.tolist(), strict=True):
        first = next(i for i, t in enumerate(targets) if t != IGNORE)
        assert all(t == IGNORE for t in targets[:first]) and targets[first:] == inputs[first + 1:] + targets[-1:]
        head = tokenizer.decode(inputs[1 : first + 1])
        assert head.count(SEPARATOR) == 1 and head.rstrip(" ").endswith(SEPARATOR)
    whole = training.corpus_batch(sources, replace(cfg, copy_repeat_loss_only=False), torch.Generator().manual_seed(0))
    assert torch.equal(whole.inputs, batch.inputs) and not (whole.targets == IGNORE).any()
