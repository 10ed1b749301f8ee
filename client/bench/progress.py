"""A progress bar on stderr: tqdm when it is installed, a plain text bar otherwise."""

from __future__ import annotations

import sys
from typing import Protocol, TextIO


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...

    def close(self) -> None: ...


class NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class TextBar:
    """`[#####.....]  12/20` redrawn in place with a carriage return."""

    def __init__(self, total: int, desc: str = "", width: int = 30, stream: TextIO | None = None) -> None:
        self.total, self.desc, self.width = total, desc, width
        self.stream = stream or sys.stderr
        self.done = 0
        self.draw()

    def draw(self) -> None:
        filled = self.width * self.done // self.total if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.desc}[{bar}] {self.done:>{len(str(self.total))}}/{self.total}")
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        self.done += n
        self.draw()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def make_progress(total: int, enabled: bool = True, desc: str = "") -> Progress:
    if not enabled:
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return TextBar(total, f"{desc}: " if desc else "")
    return tqdm(total=total, desc=desc or None, file=sys.stderr, unit="req")
