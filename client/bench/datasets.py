"""Benchmark requests: a seeded synthetic ShareGPT-like set, a seeded prefix-repetition set (vLLM's),
a JSON request file, or a ShareGPT file."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

TokenCounter = Callable[[str], int]

SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


class DatasetError(ValueError):
    """A dataset file that cannot be read as benchmark requests; the message names the place."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_len: int
    max_tokens: int
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    json_schema: str | None = None  # the output must match this JSON schema (structured outputs)


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    num_prompts: int = 1000
    input_mean: float = 256.0
    output_mean: float = 128.0
    input_max: int = 1024
    output_max: int = 1024
    sigma: float = 1.0
    vocab_size: int = 256
    min_token_id: int = 10
    seed: int = 0


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, max_len: int) -> list[int]:
    """n lengths from a lognormal with the given mean (before clipping), rounded and clipped to [1, max_len]."""
    mu = math.log(mean) - sigma * sigma / 2
    raw = rng.lognormal(mu, sigma, size=n)
    return [int(x) for x in np.clip(np.rint(raw), 1, max_len)]


def synthetic_requests(cfg: SyntheticConfig) -> list[BenchRequest]:
    if cfg.vocab_size <= cfg.min_token_id:
        raise DatasetError(f"--synthetic-vocab-size must be > {cfg.min_token_id}, got {cfg.vocab_size}")
    rng = np.random.default_rng(cfg.seed)
    inputs = lognormal_lengths(rng, cfg.num_prompts, cfg.input_mean, cfg.sigma, cfg.input_max)
    outputs = lognormal_lengths(rng, cfg.num_prompts, cfg.output_mean, cfg.sigma, cfg.output_max)
    return [BenchRequest(prompt_len=n_in, max_tokens=n_out,
                         prompt_token_ids=tuple(int(t) for t in rng.integers(cfg.min_token_id, cfg.vocab_size,
                                                                             size=n_in)))
            for n_in, n_out in zip(inputs, outputs, strict=True)]


@dataclass(frozen=True, slots=True)
class PrefixRepetitionConfig:
    """vLLM's prefix-repetition dataset: num_prefixes random prefixes of prefix_len tokens, each request
    one of them (in turn, then shuffled) followed by its own random suffix of suffix_len tokens."""

    num_prompts: int = 100
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    vocab_size: int = 256
    min_token_id: int = 10
    seed: int = 0


def prefix_repetition_requests(cfg: PrefixRepetitionConfig) -> list[BenchRequest]:
    if cfg.vocab_size <= cfg.min_token_id:
        raise DatasetError(f"--synthetic-vocab-size must be > {cfg.min_token_id}, got {cfg.vocab_size}")
    if cfg.num_prefixes < 1 or cfg.prefix_len + cfg.suffix_len < 1 or cfg.output_len < 1:
        raise DatasetError("--prefix-repetition-num-prefixes and -output-len must be >= 1 and a prompt non-empty")
    rng = np.random.default_rng(cfg.seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(cfg.min_token_id, cfg.vocab_size, size=n))

    prefixes = [tokens(cfg.prefix_len) for _ in range(cfg.num_prefixes)]
    prompts = [prefixes[i % cfg.num_prefixes] + tokens(cfg.suffix_len) for i in range(cfg.num_prompts)]
    order = rng.permutation(cfg.num_prompts)
    return [BenchRequest(prompt_len=len(prompts[i]), max_tokens=cfg.output_len, prompt_token_ids=prompts[i])
            for i in order]


JSON_SCHEMA_LEAVES: tuple[dict[str, Any], ...] = (
    {"type": "integer", "minimum": 0, "maximum": 9999}, {"type": "boolean"}, {"type": "string", "maxLength": 16},
    {"type": "string", "enum": ["red", "green", "blue"]}, {"type": "array", "items": {"type": "number"}, "maxItems": 4},
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
)


def json_schema_of(i: int) -> dict[str, Any]:
    """The i-th schema of the json-schema dataset: 2-5 properties of varied kinds, every third one nested."""
    props: dict[str, Any] = {f"field_{i}_{j}": JSON_SCHEMA_LEAVES[(i + j) % len(JSON_SCHEMA_LEAVES)]
                             for j in range(2 + i % 4)}
    if i % 3 == 0:
        props["nested"] = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string",
                                                                                               "maxLength": 12}},
                           "required": ["id", "name"]}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def json_schema_requests(num_prompts: int, max_tokens: int, num_schemas: int = 16) -> list[BenchRequest]:
    """vLLM's structured-output benchmark in spirit: each request asks for a JSON document matching one of
    num_schemas generated schemas (in turn), with a text prompt describing it."""
    out = []
    for i in range(num_prompts):
        schema = json.dumps(json_schema_of(i % num_schemas))
        prompt = f"Generate a JSON document for record {i} matching this schema: {schema}"
        out.append(BenchRequest(prompt_len=len(prompt.encode()), max_tokens=max_tokens, prompt=prompt,
                                json_schema=schema))
    return out


def byte_counter(text: str) -> int:
    return len(text.encode("utf-8"))


def tokenizer_counter(directory: str | Path) -> TokenCounter:
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise DatasetError(f"--tokenizer {directory}: no tokenizer.json there")
    tokenizer = Tokenizer.from_file(str(path))
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)


def read_json(path: str | Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"{path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not JSON: {e}") from e


def request_list(data: Any, path: str | Path) -> list[Any]:
    if isinstance(data, dict) and "requests" in data:
        data = data["requests"]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a list of requests or an object with a 'requests' list")
    return data


def parse_request(item: Any, where: str, count: TokenCounter) -> BenchRequest:
    if not isinstance(item, dict):
        raise DatasetError(f"{where}: expected an object")
    max_tokens = item.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise DatasetError(f"{where}.max_tokens: expected an integer >= 1, got {max_tokens!r}")
    ids, prompt = item.get("prompt_token_ids"), item.get("prompt")
    if (ids is None) == (prompt is None):
        raise DatasetError(f"{where}: give exactly one of 'prompt' and 'prompt_token_ids'")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise DatasetError(f"{where}.prompt_token_ids: expected a non-empty list of token ids")
        return BenchRequest(prompt_len=len(ids), max_tokens=max_tokens, prompt_token_ids=tuple(ids))
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where}.prompt: expected a non-empty string")
    return BenchRequest(prompt_len=count(prompt), max_tokens=max_tokens, prompt=prompt)


def json_requests(data: Any, path: str | Path, count: TokenCounter) -> list[BenchRequest]:
    return [parse_request(item, f"{path}: requests[{i}]", count) for i, item in enumerate(request_list(data, path))]


def first_exchange(conversations: Any) -> tuple[str, str] | None:
    """The first human turn and the turn that answers it, or None when there is no such pair."""
    if not isinstance(conversations, list):
        return None
    for i, turn in enumerate(conversations[:-1]):
        reply = conversations[i + 1]
        if (isinstance(turn, dict) and turn.get("from") == "human" and isinstance(reply, dict)
                and isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str)):
            return turn["value"], reply["value"]
    return None


def keep_sharegpt_pair(prompt_len: int, output_len: int) -> bool:
    """vLLM's ShareGPT filter: no prompt or output under 4 tokens, prompt <= 1024, prompt + output <= 2048."""
    return (prompt_len >= SHAREGPT_MIN_LEN and output_len >= SHAREGPT_MIN_LEN
            and prompt_len <= SHAREGPT_MAX_PROMPT_LEN and prompt_len + output_len <= SHAREGPT_MAX_TOTAL_LEN)


def sharegpt_requests(data: Any, path: str | Path, count: TokenCounter) -> list[BenchRequest]:
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a list of {{'conversations': [...]}} entries")
    out: list[BenchRequest] = []
    for entry in data:
        pair = first_exchange(entry.get("conversations") if isinstance(entry, dict) else None)
        if pair is None:
            continue
        prompt, reply = pair
        prompt_len, output_len = count(prompt), count(reply)
        if keep_sharegpt_pair(prompt_len, output_len):
            out.append(BenchRequest(prompt_len=prompt_len, max_tokens=output_len, prompt=prompt))
    return out


def looks_like_sharegpt(data: Any) -> bool:
    return isinstance(data, list) and bool(data) and isinstance(data[0], dict) and "conversations" in data[0]


def load_file(path: str | Path, fmt: str = "auto", count: TokenCounter = byte_counter) -> list[BenchRequest]:
    """Requests from FILE; fmt is 'json', 'sharegpt', or 'auto' (ShareGPT when entries have 'conversations')."""
    data = read_json(path)
    if fmt == "sharegpt" or (fmt == "auto" and looks_like_sharegpt(data)):
        return sharegpt_requests(data, path, count)
    if fmt not in ("json", "auto"):
        raise DatasetError(f"unknown dataset format {fmt!r}")
    return json_requests(data, path, count)


def take(requests: Iterable[BenchRequest], n: int | None) -> list[BenchRequest]:
    items = list(requests)
    return items if n is None else items[:n]
