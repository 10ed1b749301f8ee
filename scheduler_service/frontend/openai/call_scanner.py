"""An incremental reader of tool-call objects in JSON text that arrives in pieces: `{"name": ..., "arguments": ...}`
(the arguments key is the parser's), as the objects themselves (hermes' tag contents, llama3_json's `;`-joined
objects: call depth 1) or as the items of an array (a `required` answer: depth 2).

It scans each character once, tracking strings and nesting, and records where each call's name and arguments
values start and end in the text. A call's arguments are its raw JSON text, trimmed of the whitespace around it;
what `available()` gives of an unfinished value is always a prefix of the finished one (whitespace at its end is
held back until something follows it), so fragments streamed as they come concatenate to exactly the arguments of
the whole answer, which is read by feeding the whole text at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

NAME_KEY = "name"


@dataclass(slots=True)
class ScannedCall:
    """One call object: where its values lie in the scanner's text (-1: not seen yet) and its name once complete."""

    name: str | None = None
    args_start: int = -1
    args_end: int = -1
    ended: bool = False
    valid: bool = True  # False: its name value or one of its keys was not a JSON string (the object is no call)


class CallScanner:
    def __init__(self, call_depth: int, args_keys: tuple[str, ...]) -> None:
        self.call_depth = call_depth
        self.args_keys = args_keys
        self.text = ""
        self.calls: list[ScannedCall] = []
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._expect_key = False
        self._key_start = -1
        self._key = ""
        self._value_pending = False
        self._value_start = -1
        self._args_key_rank = len(args_keys)

    def feed(self, text: str) -> None:
        start = len(self.text)
        self.text += text
        for i in range(start, len(self.text)):
            self._scan(i, self.text[i])

    def _scan(self, i: int, c: str) -> None:
        if self._in_string:
            self._scan_string(i, c)
            return
        if c.isspace():
            return
        at_call = self._depth == self.call_depth
        if at_call and self._value_pending:
            self._value_pending, self._value_start = False, i
            self._start_value(i)
        if c == '"':
            self._in_string = True
            if at_call and self._expect_key:
                self._key_start = i
        elif c in "{[":
            if c == "{" and self._depth == self.call_depth - 1:
                self.calls.append(ScannedCall())
                self._expect_key, self._args_key_rank = True, len(self.args_keys)
            self._depth += 1
        elif c in "}]":
            if at_call:
                self._end_value(i)
                if self.calls:
                    self.calls[-1].ended = True
            self._depth -= 1
        elif at_call and c == ",":
            self._end_value(i)
            self._expect_key = True
        elif at_call and c == ":":
            self._value_pending = True

    def _scan_string(self, i: int, c: str) -> None:
        if self._escape:
            self._escape = False
        elif c == "\\":
            self._escape = True
        elif c == '"':
            self._in_string = False
            if self._key_start >= 0:
                self._key = self._read_key(self.text[self._key_start:i + 1])
                self._key_start, self._expect_key = -1, False

    def _read_key(self, raw: str) -> str:
        """A key's string; a key that is not a JSON string (an invalid escape) names nothing and spoils its call."""
        try:
            return str(json.loads(raw))
        except ValueError:
            if self.calls:
                self.calls[-1].valid = False
            return ""

    def _start_value(self, i: int) -> None:
        if not self.calls or self._key not in self.args_keys:
            return
        rank = self.args_keys.index(self._key)  # a call with both keys: the first-named key's value counts
        call = self.calls[-1]
        if call.args_start < 0 or rank < self._args_key_rank:
            call.args_start, call.args_end, self._args_key_rank = i, -1, rank

    def _end_value(self, i: int) -> None:
        if not self.calls or self._value_start < 0:
            return
        call = self.calls[-1]
        raw = self.text[self._value_start:i].rstrip()
        if self._key == NAME_KEY:
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
            call.valid = call.valid and isinstance(name, str)
        elif self._key in self.args_keys and call.args_start == self._value_start:
            call.args_end = i
        self._value_start = -1

    def arguments(self, call: ScannedCall) -> str:
        """A finished call's arguments text ("{}" when it had none)."""
        if call.args_start < 0:
            return "{}"
        return self.text[call.args_start:call.args_end].rstrip()

    def available(self, call: ScannedCall) -> str:
        """As much of the call's arguments text as is certain: all of it once the value ended, else what has come
        without the whitespace at its end."""
        if call.args_start < 0:
            return ""
        if call.args_end >= 0:
            return self.text[call.args_start:call.args_end].rstrip()
        return self.text[call.args_start:].rstrip()
