"""splitmix64 of (key, position): the one hash behind seeded sampling and the simulated model's tokens."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def splitmix64(key: int, position: int) -> int:
    """A 64-bit value that depends on (key, position) only: the same on every run and in every process."""
    z = (key * 0x9E3779B97F4A7C15 + position + 1) & MASK64
    for _ in range(2):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
    return z
