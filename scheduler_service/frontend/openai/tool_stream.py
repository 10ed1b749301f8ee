"""Streaming a `required` or `auto` chat answer as OpenAI tool-call deltas while it is generated, as vLLM does.

A call's first delta carries its index, id, type and function name (once the name is complete); the deltas after
it carry fragments of its arguments as they are generated (call_scanner.py: the raw JSON text, so that the
fragments concatenate to exactly the non-streamed `arguments`); parallel calls get increasing indexes.

- `required`: the answer is a JSON array of `{"name", "parameters"}` objects (the constraint makes it so).
- `auto` with hermes: text outside `<tool_call>...</tool_call>` streams as content (a possible start of the tag at
  the end of what came is held back; after a call, whitespace only with other text); inside a tag the call object
  is read. A block whose name is not an offered
  function, or that holds no call, is sent as content, as the non-streamed reading keeps it as text.
- `auto` with llama3_json: an answer that starts with `{` or `<|python_tag|>` is read as `;`-joined call objects,
  any other as content. A call to a function not offered before any call was sent turns the answer into content
  (as non-streamed); after one, it is left out (the non-streamed answer would then be content: the one case where
  the two differ, besides an answer cut by max_tokens, whose streamed calls stay sent).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from scheduler_service.frontend.openai.call_scanner import CallScanner, ScannedCall
from scheduler_service.frontend.openai.tools import ToolCall, ToolCallParser, ToolChoice, ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class Mode(enum.Enum):
    UNDECIDED = "undecided"  # llama3_json: nothing but whitespace (or part of the python tag) yet
    CONTENT = "content"
    CALLS = "calls"  # required, llama3_json: the rest is calls; hermes: inside a tag
    BAD_BLOCK = "bad block"  # hermes: inside a tag that is not a call (sent as content)


@dataclass(slots=True)
class Tracked:
    call: ToolCall
    index: int
    emitted: int = 0  # characters of its arguments sent


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of text could begin `tag` (held until the next text says)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolStream:
    """One choice's answer, fed text as it is generated: content and tool-call delta parts out."""

    def __init__(self, tools: ToolRequest, parser: ToolCallParser) -> None:
        self.names = set(tools.schemas)
        self.required = tools.choice is ToolChoice.REQUIRED
        self.hermes = parser is ToolCallParser.HERMES and not self.required
        self.mode = Mode.CALLS if self.required else Mode.CONTENT if self.hermes else Mode.UNDECIDED
        self.scanner = self._new_scanner()
        self.pending = ""
        self.raw = ""  # llama3_json: everything fed, for an answer that turns out to be content
        self.block_raw = ""  # hermes: the current tag's text
        self.gap = ""  # hermes: whitespace after a call, sent only if other text follows
        self.tracked: list[Tracked | None] = []  # the current scanner's calls (by position): sent ones
        self.num_calls = 0

    def _new_scanner(self) -> CallScanner:
        if self.required:
            return CallScanner(2, ("parameters",))
        return CallScanner(1, ("arguments",) if self.hermes else ("parameters", "arguments"))

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The content to send and the tool-call parts (one per call that moved) for this piece of the answer."""
        if self.required:
            self.scanner.feed(text)
            return "", self._progress()
        return self._feed_hermes(text) if self.hermes else self._feed_llama3(text)

    def finish(self) -> str:
        """The content held back, at the end of the answer."""
        rest, self.pending = self.pending, ""
        if self.hermes and self.mode is Mode.CONTENT and self.num_calls:
            rest = self._content_after_calls(rest)
        if self.hermes and self.mode is Mode.CALLS and not self._block_announced():
            return OPEN + self.block_raw + rest
        if self.required and not self.num_calls:
            return self.scanner.text  # cut by a stop string before a call was read: the answer is text
        if self.mode is Mode.UNDECIDED or (self.mode is Mode.CALLS and not self.hermes and not self.num_calls):
            return self.raw  # llama3_json: no call came of it: the answer is text
        return rest if self.mode is not Mode.CALLS else ""

    # ---- calls -----------------------------------------------------------------------------------

    def _progress(self) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        self.tracked += [None] * (len(self.scanner.calls) - len(self.tracked))
        for i, scanned in enumerate(self.scanner.calls):
            tracked = self.tracked[i]
            if tracked is None:
                if scanned.name is None or not scanned.valid or scanned.name not in self.names:
                    continue
                tracked = self.tracked[i] = self._announce(scanned, parts)
            text = self.scanner.arguments(scanned) if scanned.ended else self.scanner.available(scanned)
            fragment = text[tracked.emitted:]
            if not fragment:
                continue
            tracked.emitted = len(text)
            if parts and parts[-1]["index"] == tracked.index:
                parts[-1]["function"]["arguments"] += fragment
            else:
                parts.append({"index": tracked.index, "function": {"arguments": fragment}})
        return parts

    def _announce(self, scanned: ScannedCall, parts: list[dict[str, Any]]) -> Tracked:
        call = ToolCall(scanned.name or "", "")
        tracked = Tracked(call, self.num_calls)
        self.num_calls += 1
        parts.append({"index": tracked.index, "id": call.id, "type": "function",
                      "function": {"name": call.name, "arguments": ""}})
        return tracked

    def _refused_name(self) -> bool:
        """The scanner read a call whose name is not an offered function (or an object that is no call)."""
        return any(not c.valid or (c.name is not None and c.name not in self.names) for c in self.scanner.calls)

    def _block_announced(self) -> bool:
        return any(t is not None for t in self.tracked)

    # ---- hermes ----------------------------------------------------------------------------------

    def _feed_hermes(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += text
        content: list[str] = []
        parts: list[dict[str, Any]] = []
        while self._hermes_step(content, parts):
            pass
        return "".join(content), parts

    def _hermes_step(self, content: list[str], parts: list[dict[str, Any]]) -> bool:
        """Read what pending allows in the current mode; True when the mode changed and there is more to read."""
        tag = OPEN if self.mode is Mode.CONTENT else CLOSE
        at = self.pending.find(tag)
        end = at if at >= 0 else len(self.pending) - held_back(self.pending, tag)
        piece, self.pending = self.pending[:end], self.pending[end:]
        if self.mode is Mode.CONTENT:
            content.append(self._content_after_calls(piece) if self.num_calls else piece)
        elif self.mode is Mode.BAD_BLOCK:
            content.append(piece + (CLOSE if at >= 0 else ""))
        else:
            self._read_block(piece, content, parts)
        if at < 0:
            return False
        self.pending = self.pending[len(tag):]
        if self.mode is Mode.CONTENT:
            self.mode, self.scanner, self.block_raw, self.tracked = Mode.CALLS, self._new_scanner(), "", []
        else:
            if self.mode is Mode.CALLS and not self._block_announced():
                content.append(OPEN + self.block_raw + CLOSE)  # no call in it: text
            self.mode = Mode.CONTENT
        return True

    def _content_after_calls(self, piece: str) -> str:
        """Text after a call: whitespace (between calls, after the last) is held until other text follows it."""
        self.gap += piece
        if not self.gap.strip():
            return ""
        out, self.gap = self.gap, ""
        return out

    def _read_block(self, piece: str, content: list[str], parts: list[dict[str, Any]]) -> None:
        self.block_raw += piece
        self.scanner.feed(piece)
        if self._refused_name() and not self._block_announced():
            content.append(OPEN + self.block_raw)
            self.mode = Mode.BAD_BLOCK
            return
        parts += self._progress()

    # ---- llama3_json -----------------------------------------------------------------------------

    def _feed_llama3(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.raw += text
        if self.mode is Mode.CONTENT:
            return text, []
        if self.mode is Mode.UNDECIDED:
            start = self.raw.lstrip()
            if not start or (PYTHON_TAG.startswith(start) and start != PYTHON_TAG):
                return "", []
            if not (start.startswith(PYTHON_TAG) or start.startswith("{")):
                self.mode = Mode.CONTENT
                return self.raw, []
            self.mode = Mode.CALLS
            text = start.removeprefix(PYTHON_TAG)
        self.scanner.feed(text)
        if self._refused_name() and not self.num_calls:
            self.mode = Mode.CONTENT
            return self.raw, []
        return "", self._progress()
