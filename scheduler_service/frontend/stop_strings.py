"""Stop strings over streamed text: the stop text is never emitted, a possible start of one is held back."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self._stops = [s for s in stops if s]
        self._pending = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def feed_unchecked(self, text: str) -> str:
        """Pass text through without matching (before min_tokens), after anything held back."""
        out, self._pending = self._pending + text, ""
        return out

    def feed(self, text: str) -> tuple[str, bool]:
        """Text that is safe to emit now, and whether a stop string was reached."""
        if not self._stops:
            return text, False
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._pending = ""
            return buf[:min(hits)], True
        hold = self._held_suffix(buf)
        self._pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

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
