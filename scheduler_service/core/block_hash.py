"""Prefix-cache identity of a full block: its parent's digest chained with its own tokens.

A key is (the parent block's digest, the block's token ids). The cache is a dict keyed by the whole key,
so a hit compares the block's tokens exactly; the parent, and through it every block before, is identified
by its digest: SHA-256 over the grandparent's digest and the parent's tokens (8 bytes each, little endian),
as vLLM's sha256 block hash. The chain starts from a root that is itself a digest over SECRET, 32 random
bytes drawn once per process, so no block's digest can be predicted, let alone aimed at, from outside the
process (the class of vLLM's CVE-2025-25183, whose fix also starts the chain from a random root). A wrong
hit would need two different prefixes whose 256-bit digests collide.

A request's root also mixes in its cache scope: the tenant (an api server's keyed digest of the caller's
API key, never the key itself; empty when the cache is shared across tenants) and vLLM's per-request
cache_salt. Requests with different scopes never share a block, so one tenant cannot learn from its time
to first token whether another sent a prefix; requests with neither share the process's plain root.
"""

from __future__ import annotations

import os
import struct
from hashlib import sha256

from scheduler_service.core.request import Request

BlockKey = tuple[bytes, tuple[int, ...]]

SECRET = os.urandom(32)
ROOT = sha256(SECRET + b"\x00pagedserve-prefix-root").digest()
_packers: dict[int, struct.Struct] = {}


def root_digest(tenant: str = "", cache_salt: str | None = None) -> bytes:
    """The digest a chain of blocks starts from: the process's ROOT for no tenant and no salt, else a digest
    over SECRET, the tenant and the salt (each length-prefixed, so no two scopes run together)."""
    if not tenant and cache_salt is None:
        return ROOT
    parts = [SECRET, b"\x01"]
    for part in (tenant, cache_salt):
        data = b"" if part is None else part.encode("utf-8", "surrogatepass")
        parts.append(struct.pack("<BQ", part is not None, len(data)))
        parts.append(data)
    return sha256(b"".join(parts)).digest()


def request_root(request: Request) -> bytes:
    return root_digest(request.tenant, request.cache_salt)


def _packer(n: int) -> struct.Struct:
    packer = _packers.get(n)
    if packer is None:
        packer = _packers[n] = struct.Struct(f"<{n}q")
    return packer


def digest(key: BlockKey) -> bytes:
    """The digest of a block's key: its children's parent."""
    tokens = key[1]
    return sha256(key[0] + _packer(len(tokens)).pack(*tokens)).digest()


def token_range(request: Request, start: int, end: int) -> tuple[int, ...]:
    prompt, output = request.prompt_token_ids, request.output_token_ids
    p = len(prompt)
    if end <= p:
        return tuple(prompt[start:end])
    if start >= p:
        return tuple(output[start - p:end - p])
    return tuple(prompt[start:]) + tuple(output[:end - p])


def prefix_keys(token_ids: list[int], block_size: int, root: bytes = ROOT) -> list[BlockKey]:
    """The keys of every full block of a token list whose chain starts at root."""
    keys: list[BlockKey] = []
    parent = root
    pack = _packer(block_size).pack
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = tuple(token_ids[start:start + block_size])
        keys.append((parent, tokens))
        parent = sha256(parent + pack(*tokens)).digest()
    return keys


def extend_keys(keys: list[BlockKey], request: Request, num_blocks: int, block_size: int) -> list[BlockKey]:
    """keys (the request's first block keys) extended in place to num_blocks full blocks."""
    if len(keys) >= num_blocks:
        return keys
    parent = digest(keys[-1]) if keys else request_root(request)
    pack = _packer(block_size).pack
    for i in range(len(keys), num_blocks):
        tokens = token_range(request, i * block_size, (i + 1) * block_size)
        keys.append((parent, tokens))
        if i + 1 < num_blocks:
            parent = sha256(parent + pack(*tokens)).digest()
    return keys
