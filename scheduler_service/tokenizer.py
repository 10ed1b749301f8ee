"""Tokenizers the scheduler uses, and incremental detokenization."""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255; ids beyond a byte decode as <id>."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        buf = bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            out.append(f"<{i}>")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    def __init__(self, tokenizer_json: str, bos_token_id: int | None = None) -> None:
        self._tok = Tokenizer.from_str(tokenizer_json)
        self._bos = bos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self._bos, *ids] if self._bos is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing list of ids into text deltas that are whole characters.

    The text of the last few tokens is decoded again with each new token, so byte-level tokens that
    split a character are held back until the character is complete.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int], context: int = 6) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-context:])
        self._read = len(self._ids)
        self._prefix_offset = 0

    def step(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read])
        full_text = self._tok.decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            delta = full_text[len(prefix_text):]
            self._prefix_offset = self._read
            self._read = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the sequence: whatever was held back waiting for more bytes, as it decodes."""
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read])
        full_text = self._tok.decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read = len(self._ids)
        return full_text[len(prefix_text):]
