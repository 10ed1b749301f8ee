"""A tokenizer's vocabulary as xgrammar reads it, from the executor's Describe (used in the engine core and in the
grammar compile process)."""

from __future__ import annotations

import json

from protos.pagedserve.v1 import executor_pb2


def tokenizer_vocab(describe: executor_pb2.DescribeResponse) -> tuple[list[str] | list[bytes], str]:
    """Every token id's text as xgrammar reads it, and the vocabulary kind: byte-level BPE strings, SentencePiece
    byte fallback, or raw bytes (no tokenizer: ids 0-255 are bytes). Special tokens are empty (never allowed)."""
    size = describe.vocab_size
    eos = set(describe.eos_token_ids)
    if not describe.tokenizer_json:
        return [b"" if i in eos or i >= 256 else bytes([i]) for i in range(size)], "RAW"
    spec = json.loads(describe.tokenizer_json)
    by_id = {i: t for t, i in spec["model"].get("vocab", {}).items()} if isinstance(
        spec["model"].get("vocab"), dict) else {}
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    for t in spec.get("added_tokens", []):
        by_id.setdefault(t["id"], t["content"])
    vocab = ["" if i in special or i in eos else by_id.get(i, "") for i in range(size)]
    return vocab, vocab_kind(spec)


def vocab_kind(spec: dict[str, object]) -> str:
    text = json.dumps(spec.get("decoder"))
    if '"ByteLevel"' in text:
        return "BYTE_LEVEL"
    return "BYTE_FALLBACK" if '"ByteFallback"' in text else "RAW"
