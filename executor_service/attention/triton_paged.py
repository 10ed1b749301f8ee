"""Triton paged attention and KV-cache write; same signatures as the reference implementation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE_N = 32
PREFILL_ROWS = 64
MIN_ROWS = 16


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
) -> None:
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = slot * stride_cs + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr) -> tl.tensor:
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a kernel for each class of its integer arguments (1, a multiple of 16, any other) and of its
# pointers' alignment (16 bytes or not). What changes from step to step: the batch's sequence count, its block
# table's width, and where the metadata lie (the decode path uploads them as one packed tensor and views it, 4 x the
# sequence count bytes apart; CUDA graphs read them from static buffers). Specialised, each new combination cost a
# compile of ~1 s in the middle of serving (an H200 serving 128 requests: 6 - 7 such stalls). The metadata are read
# one scalar at a time, so alignment buys them nothing.
METADATA_POINTERS = ["block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr"]


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"], do_not_specialize_on_alignment=METADATA_POINTERS)
def _paged_attention_kernel(
    out_ptr,
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
    UPCAST: tl.constexpr,
) -> None:
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = local_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_valid = (rows // GROUP_PAD < BLOCK_Q) & (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = context_start + q_idx
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < head_dim

    token = (q_start + q_idx).to(tl.int64)
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_offs = token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(query_ptr + q_offs, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    last_q = tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = context_start + last_q + 1
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, TILE)
    for tile_start in range(0, kv_end, TILE):
        kv_pos = tile_start + cols
        kv_valid = kv_pos < kv_end
        block_id = tl.load(table + kv_pos // BLOCK_SIZE, mask=kv_valid, other=0).to(tl.int64)
        kv_offs = block_id * stride_cb + (kv_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = kv_valid[:, None] & dim_valid[None, :]
        k = tl.load(k_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
        causal = (kv_pos[None, :] <= q_pos[:, None]) & kv_valid[None, :]
        scores = tl.where(causal, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        m_i = m_new

    acc = acc / l_i[:, None]
    o_offs = token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=q_mask)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _needs_upcast(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _interpreting())


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Scatter key/value [num_tokens, kv_heads, head_dim] into caches at flat slots, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _require(key.stride(-1) == 1 and value.stride(-1) == 1, "key/value need a contiguous last dimension")
    _require(k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape,
             "k_cache and v_cache must be contiguous and of one shape")
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _row_layout(num_tokens: int, num_seqs: int, group: int) -> tuple[int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_M): each program owns BLOCK_Q tokens x GROUP_PAD heads of one kv head."""
    group_pad = triton.next_power_of_2(group)
    if num_tokens <= num_seqs:
        return group_pad, 1, max(MIN_ROWS, group_pad)
    rows = max(PREFILL_ROWS, group_pad)
    return group_pad, rows // group_pad, rows


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
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _require(query.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous(),
             "query needs a contiguous last dimension and the caches must be contiguous")
    _require(k_cache.shape == v_cache.shape and block_tables.stride(-1) == 1,
             "k_cache and v_cache must be of one shape; block_tables rows contiguous")
    _require(num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    group_pad, block_q, block_m = _row_layout(num_tokens, num_seqs, group)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * 1.4426950408889634,
        num_seqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        head_dim,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        TILE=TILE_N,
        UPCAST=_needs_upcast(query.dtype),
    )
    return out


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
