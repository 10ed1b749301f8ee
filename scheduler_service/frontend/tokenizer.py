"""Tokenizers the scheduler uses, and incremental detokenization (TokenStream)."""

from __future__ import annotations

import asyncio
import codecs
from concurrent.futures import Executor
from typing import Protocol

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

INLINE_ENCODE_CHARS = 4096


class TokenStream(Protocol):
    """Incremental detokenization of one sequence: text deltas that are whole characters."""

    def step(self, new_ids: list[int]) -> str: ...

    def flush(self) -> str: ...


class TextTokenizer(Protocol):
    max_token_bytes: int  # the longest token's text in UTF-8 bytes: bounds the text a token count can hold

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def stream(self, prompt_ids: list[int]) -> TokenStream: ...


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

    def stream(self, prompt_ids: list[int]) -> TokenStream:
        return ByteStream()


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

    def stream(self, prompt_ids: list[int]) -> TokenStream:
        return HFStream(self._tok, prompt_ids)


class ByteStream:
    """ByteTokenizer's stream: the standard library's incremental UTF-8 decoder holds a split character back."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, new_ids: list[int]) -> str:
        out: list[str] = []
        for i in new_ids:
            if i < 256:
                out.append(self._utf8.decode(bytes((i,))))
                continue
            out.append(self.flush())
            out.append(f"<{i}>")
        return "".join(out)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


class HFStream:
    """A Hugging Face tokenizer's stream: tokenizers' DecodeStream (as vLLM V1 uses it) holds back tokens
    until they decode to whole characters."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], context: int = 6) -> None:
        self._tok = tokenizer
        self._decode = DecodeStream(ids=prompt_ids[-context:], skip_special_tokens=True)
        self._held: list[int] = []

    def step(self, new_ids: list[int]) -> str:
        out: list[str] = []
        for i in new_ids:
            piece = self._decode.step(self._tok, i)
            if piece is None:
                self._held.append(i)
                continue
            self._held.clear()
            out.append(piece)
        return "".join(out)

    def flush(self) -> str:
        """At the end of the sequence: the tokens held back waiting for more bytes, as they decode."""
        text = self._tok.decode(self._held, skip_special_tokens=True) if self._held else ""
        self._held.clear()
        return text
