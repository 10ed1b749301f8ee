"""The embedded default model, and small random models for tests and benchmarks.

The default model is a tiny Llama trained on the shipped corpus (executor_service/default_model/training.py); its
bfloat16 weights ship in executor_service/default_model/data/default-model-v2, and `ensure_default_model()` returns
that directory.
`python -m executor_service.default_model OUT_DIR` copies it to OUT_DIR; `... train` retrains it;
`... corpus` regenerates the generated half of the corpus. `make_model(...)` writes small random-weight variants
(Llama, Mistral, Qwen2) for tests, and `ensure_random_model()` caches the random benchmark model under
$PAGEDSERVE_CACHE_DIR (or ~/.cache/pagedserve).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from executor_service.default_model.paths import DATA_DIR
from executor_service.default_model.paths import DEFAULT_MODEL_NAME as DEFAULT_MODEL_NAME  # re-exported
from executor_service.default_model.paths import TRAINED_MODEL_DIR as TRAINED_MODEL_DIR
from executor_service.default_model.paths import ensure_default_model as ensure_default_model

RANDOM_MODEL_NAME = "random-model-v1"
CACHE_ENV = "PAGEDSERVE_CACHE_DIR"
CORPUS_PATH = DATA_DIR / "default_corpus.txt"
GENERATED_CORPUS_PATH = DATA_DIR / "generated_corpus.txt"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
TOKENIZER_VOCAB_SIZE = 2048
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclass(slots=True, frozen=True)
class ModelSpec:
    arch: str = "llama"
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = TOKENIZER_VOCAB_SIZE
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    init_std: float = 0.02
    seed: int = 0
    legacy_config: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


DEFAULT_SPEC = ModelSpec()
TRAINED_SPEC = ModelSpec(intermediate_size=512, tie_word_embeddings=True, max_position_embeddings=1024)


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE_DIR, or ~/.cache/pagedserve: where built models are cached."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "pagedserve"


def random_model_dir() -> Path:
    return cache_dir() / RANDOM_MODEL_NAME


def ensure_random_model() -> Path:
    """Return the cached random-weight model (DEFAULT_SPEC) directory, creating it atomically on first use."""
    final = random_model_dir()
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{RANDOM_MODEL_NAME}-", dir=final.parent))
    try:
        write_model(tmp, DEFAULT_SPEC)
        tmp.chmod(0o755)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_model(
    out_dir: Path | str,
    *,
    arch: str = "llama",
    hidden_size: int = 64,
    intermediate_size: int | None = None,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    init_std: float = 0.02,
    seed: int = 0,
    legacy_config: bool = False,
) -> Path:
    """Write a small random model of the given variant (with the default tokenizer) to out_dir."""
    spec = ModelSpec(
        arch=arch,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=attention_bias or arch == "qwen2",
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        init_std=init_std,
        seed=seed,
        legacy_config=legacy_config,
    )
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_model(path, spec)
    return path


def write_model(out_dir: Path, spec: ModelSpec) -> None:
    if spec.arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {spec.arch!r}")
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    write_json(out_dir / "config.json", build_config(spec))
    save_file(build_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(out_dir, spec, train_tokenizer())


def write_tokenizer_files(out_dir: Path, spec: ModelSpec, tokenizer: Tokenizer) -> None:
    write_json(out_dir / "generation_config.json", {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID})
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(spec))
    unk, bos, eos = SPECIAL_TOKENS
    write_json(out_dir / "special_tokens_map.json", {"bos_token": bos, "eos_token": eos, "unk_token": unk})


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def build_config(spec: ModelSpec) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": spec.init_std,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_kv_heads,
        "pad_token_id": None,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": spec.vocab_size,
    }
    config.update(arch_fields(spec))
    config.update(rope_fields(spec))
    config["torch_dtype" if spec.legacy_config else "dtype"] = "float32"
    return config


def arch_fields(spec: ModelSpec) -> dict[str, Any]:
    if spec.arch == "llama":
        return {"attention_bias": spec.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
    if spec.arch == "mistral":
        return {"sliding_window": None}
    return {
        "layer_types": ["full_attention"] * spec.num_layers,
        "max_window_layers": spec.num_layers,
        "sliding_window": None,
        "use_sliding_window": False,
    }


def rope_fields(spec: ModelSpec) -> dict[str, Any]:
    scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
    if spec.legacy_config:
        return {"rope_theta": spec.rope_theta, "rope_scaling": scaling}
    return {"rope_parameters": {"rope_theta": spec.rope_theta, **(scaling or {"rope_type": "default"})}}


def build_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(spec.seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(spec):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=generator) * spec.init_std
    return weights


def weight_shapes(spec: ModelSpec) -> list[tuple[str, tuple[int, ...]]]:
    h, inter = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    o_bias = spec.attention_bias and spec.arch == "llama"
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (spec.vocab_size, h))]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        for proj, out in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes.append((f"{p}.self_attn.{proj}.weight", (out, h)))
            if spec.attention_bias:
                shapes.append((f"{p}.self_attn.{proj}.bias", (out,)))
        shapes.append((f"{p}.self_attn.o_proj.weight", (h, q)))
        if o_bias:
            shapes.append((f"{p}.self_attn.o_proj.bias", (h,)))
        shapes += [
            (f"{p}.mlp.gate_proj.weight", (inter, h)),
            (f"{p}.mlp.up_proj.weight", (inter, h)),
            (f"{p}.mlp.down_proj.weight", (h, inter)),
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
    shapes.append(("model.norm.weight", (h,)))
    if not spec.tie_word_embeddings:
        shapes.append(("lm_head.weight", (spec.vocab_size, h)))
    return shapes


def read_corpus() -> str:
    """The hand-written corpus followed by the generated one."""
    parts = [CORPUS_PATH.read_text(encoding="utf-8"), GENERATED_CORPUS_PATH.read_text(encoding="utf-8")]
    return "\n\n".join(part.strip() for part in parts) + "\n"


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE trained on the shipped corpus; deterministic for a given tokenizers version."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([read_corpus()], trainer)
    return tokenizer


def build_tokenizer_config(spec: ModelSpec) -> dict[str, Any]:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": SPECIAL_TOKENS[1],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SPECIAL_TOKENS[2],
        "model_max_length": spec.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": SPECIAL_TOKENS[0],
    }

