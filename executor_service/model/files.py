"""Reading a model directory's tokenizer files: tokenizer.json, tokenizer_config.json (BOS, chat template),
chat_template.jinja, and the EOS ids of config.json and generation_config.json. A missing file, or a
JSON file that does not hold an object, reads as empty."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from executor_service.model.config import ModelConfig


@dataclass(slots=True, frozen=True)
class TokenizerFiles:
    """What the executor reports of its model's tokenizer (BackendInfo's tokenizer fields)."""

    tokenizer_json: str
    bos_token_id: int | None
    add_bos_token: bool
    eos_token_ids: tuple[int, ...]
    chat_template: str


def read_tokenizer_files(model_dir: Path, model_cfg: ModelConfig) -> TokenizerFiles:
    tokenizer_json = read_text(model_dir / "tokenizer.json")
    bos_token_id, add_bos = read_bos(model_dir, tokenizer_json, model_cfg.bos_token_id)
    return TokenizerFiles(tokenizer_json, bos_token_id, add_bos, read_eos_ids(model_dir, model_cfg),
                          read_chat_template(model_dir))


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8") if path.is_file() else ""


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def read_chat_template(model_dir: Path) -> str:
    """chat_template.jinja if present, else tokenizer_config.json's chat_template (a string, or a list of
    named templates of which "default" is used)."""
    jinja = read_text(model_dir / "chat_template.jinja")
    if jinja:
        return jinja
    template = read_json(model_dir / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else ""


def read_eos_ids(model_dir: Path, cfg: ModelConfig) -> tuple[int, ...]:
    generation_eos = read_json(model_dir / "generation_config.json").get("eos_token_id")
    extra = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    ids = [*cfg.eos_token_ids, *(int(i) for i in extra if isinstance(i, int))]
    return tuple(dict.fromkeys(ids))


def read_bos(model_dir: Path, tokenizer_json: str, config_bos: int | None) -> tuple[int | None, bool]:
    """BOS id, and whether the scheduler must prepend it (tokenizer_config says so and the
    tokenizer.json post-processor does not already add it)."""
    tok_config = read_json(model_dir / "tokenizer_config.json")
    bos = tok_config.get("bos_token")
    bos_text = bos.get("content") if isinstance(bos, dict) else bos
    tokenizer = json.loads(tokenizer_json) if tokenizer_json else {}
    bos_id = lookup_token_id(tokenizer, bos_text) if isinstance(bos_text, str) else None
    bos_id = config_bos if bos_id is None else bos_id
    post_adds_bos = isinstance(bos_text, str) and bos_text in json.dumps(tokenizer.get("post_processor"))
    add_bos = bool(tok_config.get("add_bos_token", False)) and bos_id is not None and not post_adds_bos
    return bos_id, add_bos


def lookup_token_id(tokenizer: dict[str, Any], text: str) -> int | None:
    for token in tokenizer.get("added_tokens") or []:
        if token.get("content") == text:
            return int(token["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and text in vocab:
        return int(vocab[text])
    return None
