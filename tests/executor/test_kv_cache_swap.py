"""KVCache swaps move exactly the blocks named, in any order, on the CPU and (where there is one) on CUDA, whose
swap area is block first so that runs of consecutive swap blocks go as one DMA."""

from __future__ import annotations

import pytest
import torch

from executor_service.runner.kv_cache import CacheShape, KVCache, contiguous_runs

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
SHAPE = CacheShape(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def test_contiguous_runs_splits_at_every_gap_and_repeat() -> None:
    assert contiguous_runs([4, 5, 6, 9, 10]) == [(0, 4, 3), (3, 9, 2)]
    assert contiguous_runs([7]) == [(0, 7, 1)]
    assert contiguous_runs([2, 2, 3]) == [(0, 2, 1), (1, 2, 2)]
    assert contiguous_runs([5, 4]) == [(0, 5, 1), (1, 4, 1)]
    assert contiguous_runs([]) == []


@pytest.mark.parametrize("device", DEVICES)
def test_shuffled_swaps_out_and_back_in_move_exactly_the_named_blocks(device: str) -> None:
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(SHAPE, num_device_blocks=24, num_swap_blocks=20, device=torch.device(device))
    cache.device_kv.copy_(torch.randn(cache.device_kv.shape, generator=generator).to(SHAPE.dtype))
    original = cache.device_kv.cpu().clone()
    sources = torch.randperm(24, generator=generator)[:12].tolist()
    # runs of consecutive swap blocks (3, 4, 5 and 10 - 13) among single ones, named out of order
    slots = [12, 3, 17, 5, 10, 4, 0, 13, 11, 8, 19, 1]
    cache.swap_out(list(zip(sources, slots, strict=True)))
    cache.device_kv.zero_()
    targets = torch.randperm(24, generator=generator)[:12].tolist()
    cache.swap_in(list(zip(slots, targets, strict=True)))
    after = cache.device_kv.cpu()  # on the compute stream, which a swap_in orders itself before
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(after[:, :, target], original[:, :, source])
    untouched = sorted(set(range(24)) - set(targets))
    assert not after[:, :, untouched].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_swap_in_may_read_one_swap_block_into_two_device_blocks(device: str) -> None:
    cache = KVCache(SHAPE, num_device_blocks=6, num_swap_blocks=4, device=torch.device(device))
    cache.device_kv.copy_(torch.arange(cache.device_kv.numel()).view(cache.device_kv.shape).to(SHAPE.dtype))
    original = cache.device_kv.cpu().clone()
    cache.swap_out([(5, 2)])
    cache.swap_in([(2, 0), (2, 3)])
    after = cache.device_kv.cpu()  # on the compute stream, which a swap_in orders itself before
    assert torch.equal(after[:, :, 0], original[:, :, 5])
    assert torch.equal(after[:, :, 3], original[:, :, 5])
