"""Stop strings over streamed text, as vLLM matches them: the text after a stop string is never emitted, nor the
stop string itself unless include_stop_str_in_output (then nothing is held back either: a possible start of one
is only held back when the stop string would be cut from the text)."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str], include: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include = include
        self._pending = ""  # text held back: it may start a stop string (without include)
        self._tail = ""  # the end of the emitted text a stop string may begin in (with include)
        self._keep = max((len(s) for s in self._stops), default=1) - 1
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed_unchecked(self, text: str) -> str:
        """Pass text through without matching (before min_tokens), after anything held back."""
        out, self._pending = self._pending + text, ""
        self._remember(out)
        return out

    def feed(self, text: str) -> tuple[str, bool]:
        """Text that is safe to emit now, and whether a stop string was reached."""
        if not self._stops:
            return text, False
        if self._include:
            return self._feed_including(text)
        buf = self._pending + text
        hit = self._first_hit(buf)
        if hit is not None:
            self._pending = ""
            return buf[:hit[0]], True
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def _feed_including(self, text: str) -> tuple[str, bool]:
        """With include_stop_str_in_output: the text up to the end of the first stop string, which may have begun
        in text already emitted."""
        buf = self._tail + text
        hit = self._first_hit(buf, len(self._tail))
        if hit is None:
            self._remember(text)
            return text, False
        return text[:hit[0] + len(hit[1]) - len(self._tail)], True

    def _first_hit(self, buf: str, new_from: int = 0) -> tuple[int, str] | None:
        """(position, stop string) of the stop string that starts first in buf among those that end past
        buf[:new_from] (the text matched before), or None."""
        hits = [(i, s) for s in self._stops if (i := buf.find(s, max(0, new_from - len(s) + 1))) >= 0]
        if not hits:
            return None
        first = min(hits, key=lambda h: h[0])
        self.matched = first[1]
        return first

    def _remember(self, emitted: str) -> None:
        if self._include and self._keep:
            self._tail = (self._tail + emitted)[-self._keep:]

    def _held_suffix(self, buf: str) -> int:
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        text, self._pending = self._pending, ""
        return text
