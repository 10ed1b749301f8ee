"""Choosing the grammar engine (#30): compile time of a JSON schema and mask fill time per token, xgrammar against
llguidance, at the default model's vocabulary (2,048) and a 151,936-token one (the default tokenizer widened with random
byte-level words, as benchmarks/structured.py's model).

    python -m benchmarks.grammar_engines

llguidance is not a dependency: install it beside the project to compare (`pip install llguidance`); without it only
xgrammar is measured. A 66-token JSON document is fed token by token and the mask filled before each token.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

from benchmarks.structured import widened_tokenizer
from executor_service.default_model.model import ensure_default_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                      "pattern": "[0-9]{5}"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
TEXT = '{"name": "Bob", "age": 42, "tags": ["a", "c"], "address": {"city": "Paris", "zip": "75001"}}'


def report(engine: str, vocab: int, setup_s: float, compile_s: float, times: list[float]) -> None:
    print(f"{engine:11s} vocab {vocab:6d}: tokenizer setup {setup_s * 1e3:7.1f} ms, compile {compile_s * 1e3:6.1f} ms, "
          f"mask p50 {statistics.median(times) * 1e6:5.0f} us, mean {statistics.mean(times) * 1e6:5.0f} us, "
          f"max {max(times) * 1e6:5.0f} us over {len(times)} tokens", flush=True)


def timed(fill: Callable[[], object], accept: Callable[[int], bool], ids: list[int]) -> list[float]:
    times = []
    for token in ids:
        t = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t)
        if not accept(token):
            raise RuntimeError(f"token {token} refused")
    return times


def xgrammar_run(tokenizer_json: str, vocab: int) -> None:
    import tokenizers
    import xgrammar

    hf = tokenizers.Tokenizer.from_str(tokenizer_json)
    words = [hf.id_to_token(i) or "" for i in range(vocab)]
    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo(words, xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[2])
    t1 = time.perf_counter()
    compiled = xgrammar.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA),
                                                                                  any_whitespace=False)
    t2 = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    times = timed(lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token, hf.encode(TEXT).ids)
    report("xgrammar", vocab, t1 - t0, t2 - t1, times)


def llguidance_run(tokenizer_json: str, vocab: int) -> None:
    try:
        import llguidance
        import llguidance.numpy as llg_numpy
    except ImportError:
        print("llguidance  not installed: skipped")
        return
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json)
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(tok, grammar)
    t2 = time.perf_counter()
    bitmask = llg_numpy.allocate_token_bitmask(1, tok.vocab_size)
    times = timed(lambda: llg_numpy.fill_next_token_bitmask(matcher, bitmask), matcher.consume_token,
                  tok.tokenize_str(TEXT))
    report("llguidance", vocab, t1 - t0, t2 - t1, times)


def main() -> None:
    default = (ensure_default_model() / "tokenizer.json").read_text()
    for vocab, tokenizer_json in ((2048, default), (151936, json.dumps(widened_tokenizer(151936)))):
        xgrammar_run(tokenizer_json, vocab)
        llguidance_run(tokenizer_json, vocab)


if __name__ == "__main__":
    main()
