"""Where the shipped default model lives, without importing torch: a tensor-parallel launch resolves it before
it spawns its ranks (they import torch while rank 0 does)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "default-model-v2"
DATA_DIR = Path(__file__).parent / "data"
TRAINED_MODEL_DIR = DATA_DIR / DEFAULT_MODEL_NAME


def ensure_default_model() -> Path:
    """The shipped trained default model's directory."""
    return TRAINED_MODEL_DIR
