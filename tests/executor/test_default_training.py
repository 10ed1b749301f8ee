"""The default model's trainer is deterministic: the same settings give the same weights, byte for byte."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from executor_service.default_model import model as dm
from executor_service.default_model.corpus import generate_corpus
from executor_service.default_model.training import TrainConfig, train

TINY = replace(dm.TRAINED_SPEC, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
SHORT = TrainConfig(steps=3, batch_size=2, seq_len=32, warmup=1, log_every=1)


def test_generated_corpus_is_reproducible_and_shipped() -> None:
    assert generate_corpus() == dm.GENERATED_CORPUS_PATH.read_text(encoding="utf-8")
    assert len(dm.read_corpus()) > 300_000


def test_training_twice_gives_identical_weights(tmp_path: Path) -> None:
    first = train(tmp_path / "a", SHORT, TINY)
    second = train(tmp_path / "b", SHORT, TINY)
    assert first == second
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (dm.TRAINED_MODEL_DIR / "tokenizer.json").read_bytes()
