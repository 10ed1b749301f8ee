"""The reference paged attention's extras (a sliding window, soft-capped scores, attention sinks) against dense
attention written out per sequence, over a shuffled paged cache, for decodes and prefill chunks behind a prefix."""

from __future__ import annotations

import pytest
import torch

from executor_service.attention.reference import Extras, Scratch, paged_attention

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 8


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, extras: Extras) -> torch.Tensor:
    """q [n, H, D] are the last n positions of a context of k/v [L, KV, D]."""
    n, length = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if extras.softcap is not None:
        scores = torch.tanh(scores / extras.softcap) * extras.softcap
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    allowed = key_pos <= query_pos
    if extras.window is not None:
        allowed &= key_pos > query_pos - extras.window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if extras.sinks is not None:
        sink = extras.sinks[:, None, None].expand(-1, n, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])


@pytest.mark.parametrize("extras", [Extras(window=5), Extras(softcap=0.7), Extras(window=3, softcap=1.5),
                                    Extras(window=64), Extras(sinks=SINKS), Extras(window=4, sinks=SINKS)])
def test_extras_equal_dense_attention(extras: Extras) -> None:
    gen = torch.Generator().manual_seed(3)
    contexts, q_lens = [1, 9, 23, 17], [1, 1, 7, 17]  # decodes, a chunk behind a prefix, a whole prompt
    num_blocks = sum(-(-c // BLOCK) for c in contexts) + 3
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-c // BLOCK) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.int32)
    for s, c in enumerate(contexts):
        for b in range(-(-c // BLOCK)):
            tables[s, b] = order.pop()
    query = torch.randn(sum(q_lens), HEADS, DIM, generator=gen) * 3
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    out = paged_attention(query, k_cache, v_cache, tables, lens, starts, 0.5, Scratch(), extras)
    for s, c in enumerate(contexts):
        slots = torch.tensor([int(tables[s, p // BLOCK]) * BLOCK + p % BLOCK for p in range(c)])
        k = k_cache.view(-1, KV_HEADS, DIM)[slots]
        v = v_cache.view(-1, KV_HEADS, DIM)[slots]
        expected = dense(query[starts[s] : starts[s + 1]], k, v, 0.5, extras)
        torch.testing.assert_close(out[starts[s] : starts[s + 1]], expected, rtol=1e-5, atol=1e-5)


def test_blocks_out_of_every_window_are_never_read() -> None:
    """A decode at position 40 with window 8 sees keys 33 - 40: blocks 0 - 7 (keys 0 - 31) may hold anything, even
    NaN (as a block released to another request would), and the output is the window's attention."""
    gen = torch.Generator().manual_seed(5)
    k_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(12, BLOCK, KV_HEADS, DIM, generator=gen)
    table = torch.arange(11, dtype=torch.int32)[None, :]
    query = torch.randn(1, HEADS, DIM, generator=gen)
    lens, starts = torch.tensor([41], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    clean = paged_attention(query, k_cache, v_cache, table, lens, starts, 0.5, Scratch(), Extras(window=8))
    k_cache[:8], v_cache[:8] = float("nan"), float("nan")
    poisoned = paged_attention(query, k_cache, v_cache, table, lens, starts, 0.5, Scratch(), Extras(window=8))
    assert torch.equal(clean, poisoned) and bool(poisoned.isfinite().all())
