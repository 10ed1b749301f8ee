"""Core lists as --cpu-cores takes them ('0-3,8'), parsed one way for both services. Standard library only."""

from __future__ import annotations

MAX_CORE = 8191  # Linux's largest CONFIG_NR_CPUS is 8,192: a larger number is a typo, not a core


def parse_cores(text: str) -> set[int]:
    """'0-3,8' -> {0, 1, 2, 3, 8}; '' -> set() (no binding); raises ValueError on anything else (an empty part, an
    open range '5-', a negative number, a core above MAX_CORE)."""
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    cores: set[int] = set()
    for part in parts:
        first, dash, last = part.partition("-")
        last = last if dash else first
        if not all(n.isascii() and n.isdigit() for n in (first, last)):
            raise ValueError(f"bad core range {part!r} in {text!r}")
        low, high = int(first), int(last)
        if high < low or high > MAX_CORE:
            raise ValueError(f"bad core range {part!r} in {text!r}")
        cores.update(range(low, high + 1))
    return cores
