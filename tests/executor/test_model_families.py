"""Every supported family beyond Llama: a random-weight directory written by transformers' save_pretrained (tied and
untied embeddings, one sharded), served by the torch backend's real model path with chunked prefill, gives
transformers' greedy tokens for prompts longer than the family's sliding window."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.model import ModelConfig
from executor_service.model.families import NormLayout, QKNorm
from executor_service.runner.torch_backend import TorchBackend
from tests.executor.test_torch_model import Driver, Seq, assert_same_tokens, hf_greedy, make_prompt

transformers = pytest.importorskip("transformers")

VOCAB = 384
WINDOW = 16
PROMPT_LENGTHS = (3, 40, 90)  # past the window: the window layers see only its last keys
NEW_TOKENS = 8
CHUNK = 32  # prefill chunks shorter than a prompt: a window reaches back into earlier chunks' blocks
BASE: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "initializer_range": 0.2, "max_position_embeddings": 512,
                        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


@dataclass(frozen=True)
class Family:
    config: Callable[..., Any]
    settings: dict[str, Any]
    shard: bool = False  # save in several safetensors files


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0],
            "long_factor": [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0], "original_max_position_embeddings": 128}

FAMILIES: dict[str, Family] = {
    "qwen3": Family(transformers.Qwen3Config, {"num_hidden_layers": 2, "head_dim": 16, "tie_word_embeddings": True}),
    "olmo2": Family(transformers.Olmo2Config, {"num_hidden_layers": 2, "tie_word_embeddings": False}, shard=True),
}


def hf_family_model(path: Path, name: str, seed: int) -> Path:
    family = FAMILIES[name]
    torch.manual_seed(seed)
    config = family.config(**{**BASE, **family.settings})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, max_shard_size="200KB" if family.shard else "1GB")
    return path


@dataclass
class Served:
    path: Path
    backend: TorchBackend
    driver: Driver
    hf: Any


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Served]:
    cache: dict[str, Served] = {}

    def get(name: str) -> Served:
        if name not in cache:
            path = hf_family_model(tmp_path_factory.mktemp(name), name, seed=len(cache) + 7)
            backend = TorchBackend.create(ExecutorConfig(model=str(path), device="cpu", block_size=8,
                                                         num_gpu_blocks=128, num_cpu_blocks=32, seed=0))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
            cache[name] = Served(path, backend, Driver(backend), hf)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(served: Callable[[str], Served], name: str) -> None:
    model = served(name)
    seqs = [Seq(f"{name}-{n}", make_prompt(n, seed=n, vocab=VOCAB), n) for n in PROMPT_LENGTHS]
    model.driver.generate(seqs, NEW_TOKENS, chunk=CHUNK)
    for seq in seqs:
        reference = hf_greedy(model.hf, seq.tokens[: seq.num_prompt], NEW_TOKENS)
        assert_same_tokens(seq.tokens[seq.num_prompt :], reference, model.backend.info.eos_token_ids)
        model.driver.release(seq)


def test_configs_name_the_family_features(served: Callable[[str], Served]) -> None:
    qwen3 = ModelConfig.from_dir(served("qwen3").path)
    assert qwen3.features.qk_norm == QKNorm.PER_HEAD and qwen3.tie_word_embeddings
    olmo2 = ModelConfig.from_dir(served("olmo2").path)
    assert olmo2.features.qk_norm == QKNorm.WHOLE and olmo2.features.norm_layout == NormLayout.POST
    assert len(list(served("olmo2").path.glob("model-*.safetensors"))) > 1
