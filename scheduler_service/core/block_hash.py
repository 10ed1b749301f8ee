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

A block's tokens enter its key as bytes (each id as 8 bytes), not as a tuple of ints: Python hashes an int to
its value and a tuple by a fixed function of its items' hashes, so token ids chosen to collide would pile keys
into one chain of the cache's dict and make every lookup a linear scan (hash flooding). Bytes are hashed with
SipHash under the process's random key (PYTHONHASHSEED unset, the default), which a client cannot predict.
"""

from __future__ import annotations

from array import array

from scheduler_service.core.request import Request

Scope = tuple[str, str | None]
Parent = int | Scope
BlockTokens = bytes  # a full block's token ids, packed by pack_tokens
BlockKey = tuple[Parent, BlockTokens] | tuple[Parent, BlockTokens, int]
"""(parent, tokens) for a full-attention block; (parent, tokens, group) for a block of a sliding-window group
(window_groups.py): the same tokens after the same prefix, held for other layers, are other contents."""

ROOT = 0  # the parent id of a request's first block; the pool numbers cached blocks from 1
NO_ID = -1  # a block whose contents the pool has not identified (not registered, or reused since)


def request_root(request: Request) -> Parent:
    """The parent of the request's first block: its cache scope."""
    if not request.tenant and request.cache_salt is None:
        return ROOT
    return (request.tenant, request.cache_salt)


def pack_tokens(token_ids: list[int]) -> BlockTokens:
    """A block's token ids as a dict key whose hash is keyed by the process (see the module's note)."""
    return array("Q", token_ids).tobytes()


def token_range(request: Request, start: int, end: int) -> BlockTokens:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return pack_tokens(prompt[start:end])
    if start >= p:
        return pack_tokens(output[start - p:end - p])
    return pack_tokens(prompt[start:] + output[:end - p])


def full_blocks(token_ids: list[int], block_size: int) -> list[BlockTokens]:
    """The token ids of every full block of a token list."""
    return [pack_tokens(token_ids[start:start + block_size])
            for start in range(0, len(token_ids) - block_size + 1, block_size)]


def extend_blocks(blocks: list[BlockTokens], request: Request, num_blocks: int,
                  block_size: int) -> list[BlockTokens]:
    """blocks (the token ids of the request's first full blocks) extended in place to num_blocks."""
    for i in range(len(blocks), num_blocks):
        blocks.append(token_range(request, i * block_size, (i + 1) * block_size))
    return blocks
