"""Prefix-cache identity of a full block: its parent's hash chained with its own tokens.

A key is (hash of the parent block's key, the block's token ids). The cache is a dict keyed by the
whole key, so a hit compares the block's tokens exactly; only the parent is identified by a 64-bit
hash (Python's tuple hash), which makes a wrong hit need a 64-bit collision between two different
prefixes followed by identical tokens.
"""

from __future__ import annotations

from scheduler_service.core.request import Request

BlockKey = tuple[int, tuple[int, ...]]

ROOT_HASH = 0x5EED


def token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return tuple(prompt[start:end])
    if start >= p:
        return tuple(output[start - p:end - p])
    return tuple(prompt[start:]) + tuple(output[:end - p])


def prefix_keys(token_ids: list[int], block_size: int) -> list[BlockKey]:
    """The keys of every full block of a token list."""
    keys: list[BlockKey] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = (parent, tuple(token_ids[start:start + block_size]))
        keys.append(key)
        parent = hash(key)
    return keys


def extend_keys(keys: list[BlockKey], request: Request, num_blocks: int, block_size: int) -> list[BlockKey]:
    """keys (the request's first block keys) extended in place to num_blocks full blocks."""
    parent = hash(keys[-1]) if keys else ROOT_HASH
    for i in range(len(keys), num_blocks):
        key = (parent, token_range(request, i * block_size, (i + 1) * block_size))
        keys.append(key)
        parent = hash(key)
    return keys
