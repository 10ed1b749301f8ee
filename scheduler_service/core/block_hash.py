"""Prefix-cache identity of a full block, exact: no hash is trusted.

A block's KV depends on every token up to its end, so a cached block may be reused only by a request
whose tokens up to there are the same. A key is (the parent's prefix id, the block's token ids): the
prefix id is a number the device pool gives each cached block when it registers it, from a counter,
never reused (evicting a block retires its number), and ROOT for a request's first block. Two keys are
then equal exactly when the blocks hold the same tokens after the same whole prefix; the cache is a dict
keyed by the whole key, so a hash collision between two keys only costs a comparison, never a wrong
hit. (A chained 64-bit hash as the parent's identity would let two different prefixes whose hashes
collide share the KV of the blocks after them; tests/core/test_kv_cache.py has such a collision.)

A request's first block's parent is its cache scope's root: ROOT when it has neither a tenant nor a
cache_salt, else the pair (tenant, cache_salt) itself. The tenant is the api server's keyed digest of the
caller's API key (never the key; "" when the cache is shared across tenants) and cache_salt is vLLM's
per-request salt, so requests of different scopes never share a block and one tenant cannot learn from
its time to first token whether another sent a prefix. With exact keys there is no hash to predict or
aim at (the class of vLLM's CVE-2025-25183): a wrong hit would need equal tokens after an equal prefix.
"""

from __future__ import annotations

from scheduler_service.core.request import Request

Scope = tuple[str, str | None]
Parent = int | Scope
BlockKey = tuple[Parent, tuple[int, ...]]

ROOT = 0  # the parent id of a request's first block; the pool numbers cached blocks from 1
NO_ID = -1  # a block whose contents the pool has not identified (not registered, or reused since)


def request_root(request: Request) -> Parent:
    """The parent of the request's first block: its cache scope."""
    if not request.tenant and request.cache_salt is None:
        return ROOT
    return (request.tenant, request.cache_salt)


def token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return tuple(prompt[start:end])
    if start >= p:
        return tuple(output[start - p:end - p])
    return tuple(prompt[start:]) + tuple(output[:end - p])


def full_blocks(token_ids: list[int], block_size: int) -> list[tuple[int, ...]]:
    """The token ids of every full block of a token list."""
    return [tuple(token_ids[start:start + block_size])
            for start in range(0, len(token_ids) - block_size + 1, block_size)]


def extend_blocks(blocks: list[tuple[int, ...]], request: Request, num_blocks: int,
                  block_size: int) -> list[tuple[int, ...]]:
    """blocks (the token ids of the request's first full blocks) extended in place to num_blocks."""
    for i in range(len(blocks), num_blocks):
        blocks.append(token_range(request, i * block_size, (i + 1) * block_size))
    return blocks
