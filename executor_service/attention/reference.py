"""Pure-torch paged attention over a block-structured KV cache (reference implementation)."""

from __future__ import annotations

import torch
from torch import Tensor


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter key/value [num_tokens, kv_heads, head_dim] into caches at flat slots; slots < 0 are skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    keep = slots >= 0
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots[keep]] = key[keep].to(k_cache.dtype)
    v_flat[slots[keep]] = value[keep].to(v_cache.dtype)


def _gather_context(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def _attend_one(query: Tensor, key: Tensor, value: Tensor, scale: float) -> Tensor:
    """query [q, h, d]; key/value [n, kv_h, d]; the q queries occupy the last q positions."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    k_pos = torch.arange(seq_len, device=query.device)
    mask = k_pos[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
) -> Tensor:
    """Causal attention of packed query tokens against each sequence's paged KV context."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        key = _gather_context(k_cache, block_tables[s], seq_len)
        value = _gather_context(v_cache, block_tables[s], seq_len)
        out[q0:q1] = _attend_one(query[q0:q1], key, value, scale).to(query.dtype)
    return out
