"""Tokenizers the scheduler uses, and incremental detokenization."""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Protocol

from tokenizers import Tokenizer

INLINE_ENCODE_CHARS = 4096


class TextTokenizer(Protocol):
    max_token_bytes: int  # the longest token's text in UTF-8 bytes: bounds the text a token count can hold

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


async def encode_off_loop(tokenizer: TextTokenizer, text: str, pool: Executor) -> list[int]:
    """Short text inline; longer text on `pool`, so one large prompt never stalls the streams of others
    (HFTokenizer.encode releases the GIL)."""
    if len(text) <= INLINE_ENCODE_CHARS:
        return tokenizer.encode(text)
    return await asyncio.get_running_loop().run_in_executor(pool, tokenizer.encode, text)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255; ids beyond a byte decode as <id>."""

    max_token_bytes = 1

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
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.max_token_bytes = max((len(t.encode()) for t in vocab), default=1)

    def encode(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not), so a worker thread leaves the event loop free.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
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
