"""The fused CPU MoE experts (csrc/moe_cpu.cpp through model/moe.py's SparseMoE.pack_experts): equal to the torch
loop over the experts up to the GEMMs' rounding at every row count a tile meets, with experts left without tokens
and with top-k > 2; bad inputs are refused with the argument named; a served MoE model packs its experts for it."""

from __future__ import annotations

import pytest
import torch

from executor_service.model import cpu_ops
from executor_service.model.families import MoEConfig
from executor_service.model.moe import SparseMoE
from executor_service.model.parallel import SINGLE

pytestmark = pytest.mark.skipif(not cpu_ops.moe_available(), reason="the fused MoE kernel needs AVX-512 and a build")


def make_moe(num_experts: int, top_k: int, inter: int, hidden: int, renormalize: bool, seed: int) -> SparseMoE:
    gen = torch.Generator().manual_seed(seed)
    moe = SparseMoE(hidden, MoEConfig(num_experts, top_k, inter, renormalize, 0, (True,)), inter, None,
                    torch.float32, SINGLE)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return moe


@pytest.mark.parametrize(("num_experts", "top_k", "inter", "hidden", "renormalize"),
                         [(8, 2, 512, 256, True), (60, 4, 16, 64, False), (8, 2, 32, 64, True)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 9, 17, 64, 130])
def test_fused_experts_equal_the_torch_loop(num_experts: int, top_k: int, inter: int, hidden: int,
                                            renormalize: bool, tokens: int) -> None:
    moe = make_moe(num_experts, top_k, inter, hidden, renormalize, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = moe(x)
        assert moe.can_fuse() and moe.packed is None
        moe.pack_experts()
        assert moe.packed is not None
        experts, weights = moe.route(x)
        fused = cpu_ops.moe_experts(x, experts, weights, *moe.packed)
        assert torch.equal(moe(x), fused)  # forward takes the fused path once packed
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_and_an_empty_batch() -> None:
    moe = make_moe(8, 2, 32, 64, True, seed=0)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[3, 5]] * 5)  # six of the eight experts get no row
    weights = torch.full((5, 2), 0.5)
    with torch.inference_mode():
        expected = moe.run_experts(x, ids, weights)
        moe.pack_experts()
        assert moe.packed is not None
        torch.testing.assert_close(cpu_ops.moe_experts(x, ids, weights, *moe.packed), expected, rtol=1e-5, atol=1e-5)
        empty = cpu_ops.moe_experts(x[:0], ids[:0], weights[:0], *moe.packed)
    assert empty.shape == (0, 64)


def test_bad_inputs_are_refused_naming_the_argument() -> None:
    moe = make_moe(8, 2, 32, 64, True, seed=0)
    moe.pack_experts()
    assert moe.packed is not None
    x, ids, weights = torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.long), torch.full((4, 2), 0.5)
    with pytest.raises(RuntimeError, match="expert ids must lie in"):
        cpu_ops.moe_experts(x, ids + 8, weights, *moe.packed)
    with pytest.raises(RuntimeError, match="expert ids must be"):
        cpu_ops.moe_experts(x, ids.int(), weights, *moe.packed)
    with pytest.raises(RuntimeError, match="routing weights"):
        cpu_ops.moe_experts(x, ids, weights.double(), *moe.packed)
    with pytest.raises(RuntimeError, match="x must be"):
        cpu_ops.moe_experts(x.double(), ids, weights, *moe.packed)
    with pytest.raises(RuntimeError, match="w13 must be"):
        cpu_ops.moe_experts(torch.randn(4, 32), ids, weights, *moe.packed)
    with pytest.raises(RuntimeError, match="w2 must be"):
        cpu_ops.moe_experts(x, ids, weights, moe.packed[0], moe.packed[1][:4])


def test_shapes_the_panels_cannot_hold_keep_the_torch_loop() -> None:
    assert not make_moe(8, 2, 8, 64, True, seed=0).can_fuse()  # intermediate not a multiple of 16 (TP=2 of 16)
    assert not make_moe(8, 2, 32, 48, True, seed=0).can_fuse()  # hidden not a multiple of 32
    moe = make_moe(8, 2, 8, 64, True, seed=0)
    moe.pack_experts()
    assert moe.packed is None
