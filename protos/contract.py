"""The plain-Python side of the executor contract, shared by both services (no protobuf, no gRPC)."""

from __future__ import annotations

BlockMap = list[tuple[int, int]]
"""(source block, destination block) pairs of one swap-out, swap-in or copy."""
