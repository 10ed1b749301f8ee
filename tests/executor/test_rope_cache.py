"""The per-model cache of RoPE's cos and sin (model/rope.py's CosSinCache, #29): a step's rows gathered from it equal
the tables' own computation bit for bit, across growth and for every RoPE variant."""

from __future__ import annotations

import pytest
import torch

from executor_service.model.config import RopeScaling
from executor_service.model.rope import CosSinCache, RopeTables

VARIANTS = {
    "default": None,
    "linear": RopeScaling(rope_type="linear", factor=4.0),
    "longrope": RopeScaling(rope_type="longrope", short_factor=tuple(1.0 + i / 10 for i in range(8)),
                            long_factor=tuple(2.0 + i / 10 for i in range(8)), original_max_position_embeddings=4096,
                            attention_factor=1.19),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_cos_sin_equal_the_tables_and_grow_past_their_capacity(variant: str) -> None:
    tables = RopeTables.of(16, 10000.0, VARIANTS[variant], torch.device("cpu"))
    cache = CosSinCache(tables)
    for positions in ([0, 1, 2], [5, 4095, 17], [4096, 6000, 3], [9000, 12]):  # the last two grow the cache
        index = torch.tensor(positions)
        got, want = cache.cos_sin(index, torch.float32), tables.cos_sin(index, torch.float32)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), positions
        assert got[0].shape == (len(positions), 1, 8) and got[0].is_contiguous()
    assert cache.cos is not None and cache.cos.shape[0] == 16384


def test_an_empty_step_gets_empty_cos_sin() -> None:
    tables = RopeTables.of(16, 10000.0, None, torch.device("cpu"))
    cos, sin = CosSinCache(tables).cos_sin(torch.empty(0, dtype=torch.long), torch.float32)
    assert cos.shape == sin.shape == (0, 1, 8)
