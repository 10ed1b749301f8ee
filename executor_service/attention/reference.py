"""Pure-torch paged attention over a block-structured KV cache (reference implementation).

Decode tokens (one query token per sequence) are batched: sequences are sorted by context length and cut
into chunks whose padded float32 K/V stay cache-sized on CPU (much larger chunks on other devices); each
chunk is gathered through a flat slot index and attended with one masked `scaled_dot_product_attention`.
Sequences with several query tokens (prefill, chunked prefill) are attended one at a time. Math is in
float32. Slots past a sequence's length are never read, so stale or non-finite cache contents cannot leak.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK_BYTES = 1 << 21
DEVICE_CHUNK_BYTES = 1 << 28
SCRATCH_MAX_BYTES = 1 << 23



class Scratch:
    """Gather buffers reused across calls by one caller (one forward thread): fresh multi-megabyte tensors
    cost more in page faults than the gather itself. Requests over SCRATCH_MAX_BYTES get a fresh tensor."""

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def get(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> Tensor:
        numel = shape[0] * shape[1]
        if numel * dtype.itemsize > SCRATCH_MAX_BYTES:
            return torch.empty(shape, dtype=dtype)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            buffer = self._buffers[name] = torch.empty(max(numel, SCRATCH_MAX_BYTES // dtype.itemsize // 4),
                                                       dtype=dtype)
        return buffer[:numel].view(shape)


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter key/value [num_tokens, kv_heads, head_dim] into caches at flat slots; slots < 0 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    keep = slots >= 0
    if bool(keep.all()):
        k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
        v_flat.index_copy_(0, slots, value.to(v_cache.dtype))
        return
    k_flat[slots[keep]] = key[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = value[keep].to(v_cache.dtype)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    scratch: Scratch | None = None,
) -> Tensor:
    """Causal attention of packed query tokens against each sequence's paged KV context.

    query [num_tokens, heads, head_dim]; caches [num_blocks, block_size, kv_heads, head_dim];
    block_tables [num_seqs, max_blocks]; seq_lens [num_seqs] (context including this step's tokens);
    query_start_loc [num_seqs + 1]. The q query tokens of a sequence occupy its last q positions."""
    num_tokens, num_seqs = query.shape[0], seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return torch.empty_like(query)
    starts, lens = _host_metadata(query_start_loc, seq_lens)
    decodes = [s for s in range(num_seqs) if starts[s + 1] - starts[s] == 1]
    chunks = list(_chunks(sorted(decodes, key=lens.__getitem__), lens, _chunk_tokens(k_cache)))
    if len(decodes) == num_tokens == num_seqs and len(chunks) == 1:
        return _decode_chunk(query, k_cache, v_cache, block_tables, seq_lens, max(lens), scale, scratch).to(query.dtype)
    out = torch.empty_like(query)
    for chunk in chunks:
        _decode_rows(query, k_cache, v_cache, block_tables, starts, lens, chunk, scale, out, scratch)
    for s in range(num_seqs):
        q0, q1 = starts[s], starts[s + 1]
        if q1 - q0 > 1:
            out[q0:q1] = _prefill_one(query[q0:q1], k_cache, v_cache, block_tables[s], lens[s], scale, scratch)
    return out


def _host_metadata(query_start_loc: Tensor, seq_lens: Tensor) -> tuple[list[int], list[int]]:
    both = torch.cat([query_start_loc.long(), seq_lens.long()]).tolist()
    split = query_start_loc.shape[0]
    return both[:split], both[split:]


def _decode_rows(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    starts: list[int],
    lens: list[int],
    chunk: list[int],
    scale: float,
    out: Tensor,
    scratch: Scratch | None,
) -> None:
    """Attend the one query token of each sequence in chunk (ascending length) and scatter it into out."""
    device = query.device
    rows = torch.tensor([starts[s] for s in chunk], device=device)
    tables = block_tables.index_select(0, torch.tensor(chunk, device=device))
    chunk_lens = torch.tensor([lens[s] for s in chunk], device=device)
    attended = _decode_chunk(query.index_select(0, rows), k_cache, v_cache, tables, chunk_lens, lens[chunk[-1]], scale,
                             scratch)
    out.index_copy_(0, rows, attended.to(out.dtype))


def _chunk_tokens(k_cache: Tensor) -> int:
    """Padded context tokens per decode chunk: float32 K of a chunk fits in cache on CPU, in a bound elsewhere."""
    budget = CHUNK_BYTES if k_cache.device.type == "cpu" else DEVICE_CHUNK_BYTES
    return max(1, budget // (k_cache.shape[2] * k_cache.shape[3] * 4))


def _chunks(order: list[int], lens: list[int], max_tokens: int) -> Iterator[list[int]]:
    """Cut sequences sorted by ascending length so that count * longest length stays within max_tokens."""
    chunk: list[int] = []
    for s in order:
        if chunk and (len(chunk) + 1) * lens[s] > max_tokens:
            yield chunk
            chunk = []
        chunk.append(s)
    if chunk:
        yield chunk


def _decode_chunk(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, lens: Tensor, max_len: int, scale: float,
    scratch: Scratch | None,
) -> Tensor:
    """query [n, heads, d], one token per sequence; tables [n, max_blocks]; lens [n] with max max_len."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    positions = torch.arange(max_len, device=query.device)
    slots = _slots(tables, torch.minimum(positions[None, :], lens[:, None] - 1), k_cache.shape[1])
    key = _gather(k_cache, slots, "k", scratch).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    value = _gather(v_cache, slots, "v", scratch).view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    mask = (positions[None, :] < lens[:, None])[:, None, None, :]
    grouped = query.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    return attended.reshape(num_seqs, num_heads, head_dim)


def _prefill_one(query: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, seq_len: int, scale: float,
                 scratch: Scratch | None) -> Tensor:
    """query [q, heads, d] at the last q of seq_len positions; table [max_blocks] is its block row."""
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    positions = torch.arange(seq_len, device=query.device)
    slots = _slots(table[None, :], positions[None, :], k_cache.shape[1])
    shape = (num_kv_heads, group, seq_len, head_dim)
    key = _per_kv_head(_gather(k_cache, slots, "k", scratch), shape)
    value = _per_kv_head(_gather(v_cache, slots, "v", scratch), shape)
    grouped = query.float().view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    if q_len == seq_len:
        attended = F.scaled_dot_product_attention(grouped, key, value, is_causal=True, scale=scale)
    else:
        mask = positions[None, :] <= positions[seq_len - q_len :, None]
        attended = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scale)
    return attended.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)


def _per_kv_head(rows: Tensor, shape: tuple[int, int, int, int]) -> Tensor:
    """Rows [seq_len, kv_heads * d] as [kv_heads, group, seq_len, d], the group dimension a stride-0 view."""
    num_kv_heads, _, seq_len, head_dim = shape
    return rows.view(seq_len, num_kv_heads, head_dim).transpose(0, 1)[:, None].expand(shape)


def _slots(tables: Tensor, positions: Tensor, block_size: int) -> Tensor:
    """Flat cache slots [n * len] of positions [n, len] through block table rows [n, max_blocks]."""
    blocks = tables.long().gather(1, positions // block_size)
    return (blocks * block_size + positions % block_size).flatten()


def _gather(cache: Tensor, slots: Tensor, name: str, scratch: Scratch | None) -> Tensor:
    """Float32 rows [len(slots), kv_heads * head_dim] of cache at flat slots (into scratch buffers on CPU)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], cache.shape[2] * cache.shape[3])
    if cache.device.type != "cpu" or scratch is None:
        return flat.index_select(0, slots).float()
    shape = (slots.shape[0], flat.shape[1])
    rows = torch.index_select(flat, 0, slots, out=scratch.get(name, cache.dtype, shape))
    return rows if rows.dtype == torch.float32 else scratch.get(f"{name}32", torch.float32, shape).copy_(rows)
