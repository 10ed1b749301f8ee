"""Incremental detokenization and stop strings with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from executor_service.default_model.model import ensure_default_model
from scheduler_service.core.request import FinishReason
from scheduler_service.frontend.generation import SequenceOutput
from scheduler_service.frontend.stop_strings import StopMatcher
from scheduler_service.frontend.tokenizer import ByteTokenizer, HFTokenizer, TextTokenizer

TEXTS = [
    "Paged attention keeps the KV cache in blocks.",
    "naïve café — déjà vu, 東京の天気は晴れ 🌤️ and emoji 👩‍💻 mixed in.",
    "Ελληνικά, русский, العربية, עברית: многобайтовые символы.",
]


@pytest.fixture(scope="module")
def hf() -> HFTokenizer:
    return HFTokenizer((ensure_default_model() / "tokenizer.json").read_text())


def stream(tok: TextTokenizer, prompt: list[int], ids: list[int], chunks: list[int]) -> list[str]:
    detok = tok.stream(prompt)
    out, i = [], 0
    for size in chunks:
        out.append(detok.step(ids[i:i + size]))
        i += size
    return out


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode(hf: HFTokenizer, text: str) -> None:
    ids = hf.encode(text)
    prompt = hf.encode("Prompt: ")
    rng = random.Random(len(text))
    chunks: list[int] = []
    while sum(chunks) < len(ids):
        chunks.append(rng.randint(1, 3))
    deltas = stream(hf, prompt, ids, chunks)
    assert "".join(deltas) == hf.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_byte_tokenizer_holds_split_characters() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é東👩")
    deltas = stream(tok, [], ids, [1] * len(ids))
    assert "".join(deltas) == "é東👩"
    assert deltas[0] == "" and deltas[1] == "é"


@pytest.mark.parametrize("text,stop", [
    ("The answer is 42. Done.", ". D"),
    ("東京の天気は晴れ", "天気"),
    ("emoji 👩‍💻 stop here", "💻 s"),
])
def test_stop_string_across_token_boundaries(hf: HFTokenizer, text: str, stop: str) -> None:
    ids = hf.encode(text)
    matcher = StopMatcher([stop])
    emitted, stopped = "", False
    for delta in stream(hf, [], ids, [1] * len(ids)):
        piece, stopped = matcher.feed(delta)
        emitted += piece
        if stopped:
            break
    assert stopped
    assert emitted == text[:text.index(stop)]


def test_stop_matcher_holds_back_possible_prefixes() -> None:
    m = StopMatcher(["STOP", "xyz"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("P!") == ("", True)
    m2 = StopMatcher(["STOP"])
    assert m2.feed("ST") == ("", False)
    assert m2.feed("ART") == ("START", False)
    assert m2.flush() == ""
    m3 = StopMatcher(["ab"])
    assert m3.feed("xa") == ("x", False)
    assert m3.flush() == "a"


def test_flush_returns_what_was_held_back_at_the_end() -> None:
    tok = ByteTokenizer()
    detok = tok.stream([])
    ids = [ord("x"), 0xE2, 0x82]
    streamed = detok.step(ids[:1]) + detok.step(ids[1:])
    assert streamed + detok.flush() == tok.decode(ids)
    assert streamed == "x"


def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back() -> None:
    m = StopMatcher(["STOP", "xyz"], include=True)
    assert m.feed("abc ST") == ("abc ST", False)  # nothing held back: the stop string stays in the text anyway
    assert m.feed("O") == ("O", False)
    assert m.feed("P! more") == ("P", True)  # a stop string that began in text already sent
    assert m.matched == "STOP" and m.flush() == ""
    early = StopMatcher(["ab"], include=True)
    assert early.feed_unchecked("xab") == "xab"  # before min_tokens: no match, even later
    assert early.feed("c") == ("c", False)
    assert early.feed("zab") == ("zab", True) and early.matched == "ab"
    plain = StopMatcher(["ab", "b"])
    assert plain.feed("xaby") == ("x", True) and plain.matched == "ab"  # the one that starts first


def sequence(tok: TextTokenizer, stops: tuple[str, ...] = (), **fields: Any) -> SequenceOutput:
    return SequenceOutput(0, tok.stream([]), StopMatcher(list(stops)), **fields)


def test_the_stop_token_that_ends_a_sequence_is_counted_but_not_in_the_text() -> None:
    """vLLM: EOS or a stop_token_ids entry that ends the sequence stays in token_ids and usage, its text is left
    out unless include_stop_str_in_output; below min_tokens it is no stop at all."""
    tok = ByteTokenizer()
    ids = tok.encode("How many")
    many = ids[3]  # " " as a stop token
    seq = sequence(tok, stop_token_ids=frozenset({many}), eos_token_ids=frozenset({0}))
    assert seq.ends_on_stop_token(ids[:4], FinishReason.STOPPED)
    assert seq.read(ids[:4], True) == ("How", None) and seq.num_tokens == 4
    kept = sequence(tok, stop_token_ids=frozenset({many}), include_stop=True)
    assert kept.read(ids[:4], kept.ends_on_stop_token(ids[:4], FinishReason.STOPPED)) == ("How ", None)
    early = sequence(tok, stop_token_ids=frozenset({many}), min_tokens=5)
    assert not early.ends_on_stop_token(ids[:4], FinishReason.STOPPED)
    assert not sequence(tok, stop_token_ids=frozenset({many})).ends_on_stop_token(ids[:4], FinishReason.LENGTH)
    eos = sequence(tok, eos_token_ids=frozenset({ord("w")}))
    assert eos.read(ids[:3], eos.ends_on_stop_token(ids[:3], FinishReason.STOPPED)) == ("Ho", None)
    stopped_before = sequence(tok, stops=("o",), stop_token_ids=frozenset({many}))
    assert stopped_before.read(ids[:4], True) == ("H", 2)  # a stop string before the stop token cuts there
