"""The torch backend's batch building: the decode-only fast path gives the general path's tensors and errors."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from executor_service.backend import BackendInfo, BatchItem, SamplingConfig
from executor_service.torch_backend import Batch, build_batch, build_decode_batch, build_mixed_batch

INFO = BackendInfo("m", vocab_size=100, eos_token_ids=(), max_model_len=512, block_size=4, num_device_blocks=64,
                   num_swap_blocks=0, dtype="float32", device="cpu")
CPU = torch.device("cpu")


def decode_items(n: int, seed: int) -> list[BatchItem]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        length = rng.randrange(1, 40)
        tokens = [rng.randrange(INFO.vocab_size) for _ in range(length)]
        start = length - 1 if rng.random() < 0.8 else rng.randrange(length)  # some recompute a past token
        table = rng.sample(range(INFO.num_device_blocks), start // INFO.block_size + 1 + rng.randrange(3))
        items.append(BatchItem(str(i), tokens, 1, start, 1, table, start + 1 == length, SamplingConfig()))
    return items


def assert_same(fast: Batch, general: Batch) -> None:
    for name in ("input_ids", "positions", "output_rows"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.sample_items, fast.decode_only) == (general.sample_items, general.decode_only)


@pytest.mark.parametrize(("n", "seed"), [(1, 0), (2, 1), (7, 2), (64, 3), (64, 4)])
def test_decode_fast_path_equals_general_path(n: int, seed: int) -> None:
    items = decode_items(n, seed)
    fast = build_decode_batch(items, INFO, CPU)
    assert fast is not None
    assert_same(fast, build_mixed_batch(items, INFO, CPU))
    assert_same(build_batch(items, INFO, CPU), fast)


def test_a_step_with_a_prefill_chunk_takes_the_general_path() -> None:
    items = decode_items(5, 5)
    items[2] = replace(items[2], start=0, num_tokens=len(items[2].token_ids), sample=True)
    batch = build_batch(items, INFO, CPU)
    assert not batch.decode_only
    assert_same(batch, build_mixed_batch(items, INFO, CPU))


@pytest.mark.parametrize(("change", "message"), [
    ({"block_table": [INFO.num_device_blocks]}, "block ids must be in"),
    ({"block_table": [-1]}, "block ids must be in"),
    ({"token_ids": [INFO.vocab_size]}, "token ids must be in"),
    ({"token_ids": [-3]}, "token ids must be in"),
])
def test_decode_fast_path_raises_the_general_errors(change: dict[str, list[int]], message: str) -> None:
    items = decode_items(4, 6)
    items[1] = replace(items[1], start=0, **{"token_ids": [5], "block_table": [3], **change})
    assert build_decode_batch(items, INFO, CPU) is None
    with pytest.raises(ValueError, match=message) as fast:
        build_batch(items, INFO, CPU)
    with pytest.raises(ValueError, match=message) as general:
        build_mixed_batch(items, INFO, CPU)
    assert str(fast.value) == str(general.value)
