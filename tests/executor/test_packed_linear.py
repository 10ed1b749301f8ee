"""Linear weights packed once for the CPU's GEMM (executor_service/model/packed.py): MKL's panels bit-identical to
F.linear from 16 rows, oneDNN's equal up to rounding; the GEMM chosen per machine; the skinny kernel for batches of
a few rows equal up to rounding, used up to the rows chosen at load."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.nn.functional import linear

from benchmarks.forward_steps import step_items
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.model import cpu_ops, packed
from executor_service.model.llama import Attention
from executor_service.model.parallel import Linear
from executor_service.runner.torch_backend import TorchBackend

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="the C++ CPU model ops cannot be built here")


@pytest.mark.parametrize("rows", [packed.MIN_ROWS, 5, packed.BITWISE_ROWS, 17, 64, 333])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear_bit_for_bit_from_16_rows(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(700, 300, generator=gen), torch.randn(700, generator=gen)
    wide = torch.randn(rows, 900, generator=gen)
    weights = packed.pack(weight)
    for x in (wide[:, :300].contiguous(), wide[:, 100:400]):  # also a row stride wider than the row (a split view)
        b = bias if with_bias else None
        out = torch.ops.pagedserve_model.linear(x, weights.panels, weight, b)
        if rows >= packed.BITWISE_ROWS:
            assert torch.equal(out, linear(x, weight, b))
        else:  # F.linear's small-matrix path rounds differently
            torch.testing.assert_close(out, linear(x, weight, b), rtol=1e-5, atol=1e-4)
        assert torch.equal(packed.dense(x, weight, b, weights), out)


def test_a_single_row_takes_f_linear() -> None:
    weight = torch.randn(64, 32)
    x = torch.randn(1, 32)
    assert packed.MIN_ROWS == 2
    assert torch.equal(packed.dense(x, weight, None, packed.pack(weight)), linear(x, weight))


def test_bad_operands_are_refused() -> None:
    weight = torch.randn(64, 32)
    weights = packed.pack(weight)
    assert weights.panels is not None
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.pagedserve_model.linear(torch.randn(20, 31), weights.panels, weight, None)
    with pytest.raises(RuntimeError, match="packed"):
        torch.ops.pagedserve_model.linear(torch.randn(20, 32), weights.panels[:10], weight, None)
    for gemm in packed.GEMMS:
        with pytest.raises(RuntimeError, match="float32"):
            packed.pack(weight.double(), gemm)


needs_onednn = pytest.mark.skipif(not packed.available("onednn"), reason="torch has no oneDNN here")


@needs_onednn
@pytest.mark.parametrize("rows", [packed.MIN_ROWS, 5, 64, 333])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_packed_linear_equals_f_linear_up_to_rounding(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(700, 300, generator=gen), torch.randn(700, generator=gen)
    wide = torch.randn(rows, 900, generator=gen)
    weights = packed.pack(weight, "onednn")
    for x in (wide[:, :300].contiguous(), wide[:, 100:400]):
        b = bias if with_bias else None
        torch.testing.assert_close(packed.dense(x, weight, b, weights), linear(x, weight, b), rtol=1e-5, atol=1e-4)
    one = wide[:1, :300]
    assert torch.equal(packed.dense(one, weight, None, weights), linear(one, weight))


def test_choose_gemm_takes_a_forced_choice_and_refuses_an_unknown_one() -> None:
    shapes = [(32, 64)]
    assert packed.choose_gemm(shapes, "mkl") == "mkl"
    assert packed.choose_gemm(shapes, "onednn") == ("onednn" if packed.available("onednn") else None)
    assert packed.choose_gemm(shapes, "auto") in packed.GEMMS
    with pytest.raises(ValueError, match="cpu_gemm"):
        packed.choose_gemm(shapes, "blas")


needs_skinny = pytest.mark.skipif(not packed.skinny_available(), reason="the skinny kernel needs AVX-512 or AVX2")


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 11, 16, 33])  # every remainder of 6-row tiles
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_f_linear_up_to_rounding(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(700, 304, generator=gen), torch.randn(700, generator=gen)
    x = torch.randn(rows, 304, generator=gen)
    b = bias if with_bias else None
    torch.testing.assert_close(torch.ops.pagedserve_model.skinny_linear(x, weight, b), linear(x, weight, b),
                               rtol=1e-5, atol=1e-4)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 20, 48])  # every remainder of 6-row tiles
# A last panel cut short, one panel, whole panels; a last panel of 36 and one of 20 columns (AVX2 takes a panel in
# quarters of 16: a short third quarter, a short second one).
@pytest.mark.parametrize("out_features", [700, 64, 1024, 676, 20])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_panels_equal_f_linear_up_to_rounding(rows: int, out_features: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, 304, generator=gen), torch.randn(out_features, generator=gen)
    x = torch.randn(rows, 304, generator=gen)
    b = bias if with_bias else None
    panels = torch.ops.pagedserve_model.pack_skinny_panels(weight)
    assert panels.shape == ((out_features + 63) // 64, 304, 64)
    torch.testing.assert_close(torch.ops.pagedserve_model.skinny_panel_linear(x, panels, out_features, b),
                               linear(x, weight, b), rtol=1e-5, atol=1e-4)


@needs_skinny
@pytest.mark.parametrize("rows", [1, 6, 7, 20])
# Less than one of the AVX2 tiles' 64-step chunks along `in`, one, one and a step, many and a part.
@pytest.mark.parametrize("in_features", [16, 48, 64, 80, 1552])
def test_skinny_panels_sum_every_chunk_of_in_features(rows: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows * in_features)
    weight, bias = torch.randn(100, in_features, generator=gen), torch.randn(100, generator=gen)
    x = torch.randn(rows, in_features, generator=gen) / in_features**0.5  # outputs of unit size at any in_features
    panels = torch.ops.pagedserve_model.pack_skinny_panels(weight)
    torch.testing.assert_close(torch.ops.pagedserve_model.skinny_panel_linear(x, panels, 100, bias),
                               linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(torch.ops.pagedserve_model.skinny_linear(x, weight, bias),
                       torch.ops.pagedserve_model.skinny_panel_linear(x, panels, 100, bias))


@needs_skinny
@pytest.mark.parametrize("rows", [2, 5, 13])
def test_the_skinny_kernel_in_place_equals_it_over_panels_bit_for_bit(rows: int) -> None:
    """A linear's results do not change when its packs (the panels) are swapped in after ready."""
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(200, 1536, generator=gen), torch.randn(200, generator=gen)
    x = torch.randn(rows, 1536, generator=gen)
    panels = torch.ops.pagedserve_model.pack_skinny_panels(weight)
    assert torch.equal(torch.ops.pagedserve_model.skinny_linear(x, weight, bias),
                       torch.ops.pagedserve_model.skinny_panel_linear(x, panels, 200, bias))


@needs_skinny
@pytest.mark.parametrize("out_features, in_features", [(700, 304), (64, 16), (130, 7), (100, 33)])
def test_skinny_panels_are_the_weight_transposed_in_64_column_panels(out_features: int, in_features: int) -> None:
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(out_features))
    panels = torch.ops.pagedserve_model.pack_skinny_panels(weight)
    expected = torch.zeros(panels.shape)
    for p in range(panels.shape[0]):
        block = weight[p * 64:(p + 1) * 64]
        expected[p, :, :block.shape[0]] = block.t()
    assert torch.equal(panels, expected)


@needs_skinny
def test_skinny_panels_refuse_operands_that_do_not_match() -> None:
    weight = torch.randn(100, 32)
    panels = torch.ops.pagedserve_model.pack_skinny_panels(weight)
    run = torch.ops.pagedserve_model.skinny_panel_linear
    with pytest.raises(RuntimeError, match="features"):
        run(torch.randn(4, 48), panels, 100, None)
    with pytest.raises(RuntimeError, match="out_features 129"):
        run(torch.randn(4, 32), panels, 129, None)
    with pytest.raises(RuntimeError, match="bias"):
        run(torch.randn(4, 32), panels, 100, torch.randn(99))
    with pytest.raises(RuntimeError, match="x must be"):
        run(torch.randn(4, 64)[:, ::2], panels, 100, None)
    with pytest.raises(RuntimeError, match="panels must be"):
        run(torch.randn(4, 32), weight, 100, None)


@needs_skinny
def test_dense_takes_the_skinny_panels_where_the_pack_has_them_and_the_weight_in_place_where_not() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(256, 128, generator=gen)
    with_panels = replace(packed.pack(weight, "onednn"), skinny_rows=8)
    assert with_panels.skinny_panels is not None
    x = torch.randn(5, 128, generator=gen)
    assert torch.equal(packed.dense(x, weight, None, with_panels),
                       torch.ops.pagedserve_model.skinny_panel_linear(x, with_panels.skinny_panels, 256, None))
    in_place = replace(with_panels, skinny_panels=None)
    assert torch.equal(packed.dense(x, weight, None, in_place),
                       torch.ops.pagedserve_model.skinny_linear(x, weight, None))


@needs_skinny
def test_dense_takes_the_skinny_kernel_up_to_its_rows_and_the_packed_gemm_above() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=gen)
    weights = replace(packed.pack(weight), skinny_rows=8)
    for rows in (2, 8):
        x = torch.randn(rows, 128, generator=gen)
        assert torch.equal(packed.dense(x, weight, None, weights),
                           torch.ops.pagedserve_model.skinny_panel_linear(x, weights.skinny_panels, 256, None))
    x = torch.randn(packed.BITWISE_ROWS, 128, generator=gen)
    assert torch.equal(packed.dense(x, weight, None, weights), linear(x, weight))
    one = x[:1]
    assert torch.equal(packed.dense(one, weight, None, weights), linear(one, weight))


@needs_skinny
def test_skinny_refuses_shapes_it_cannot_tile() -> None:
    assert not packed.can_skinny(torch.randn(64, 24)) and not packed.can_skinny(torch.randn(62, 32))
    assert packed.can_skinny(torch.randn(64, 32)) and not packed.can_skinny(torch.randn(64, 32).double())
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.pagedserve_model.skinny_linear(torch.randn(4, 24), torch.randn(64, 24), None)
    with pytest.raises(RuntimeError, match="features"):
        torch.ops.pagedserve_model.skinny_linear(torch.randn(4, 48), torch.randn(64, 32), None)


@needs_skinny
def test_choose_skinny_rows_takes_a_forced_count_and_refuses_a_bad_one() -> None:
    weights = [torch.randn(64, 32)]
    packs = [packed.pack(weights[0])]
    assert packed.choose_skinny_rows(weights, packs, 0) == 0
    assert packed.choose_skinny_rows(weights, packs, 12) == 12
    assert packed.choose_skinny_rows(weights, packs) in (0, *packed.SKINNY_CALIBRATION_ROWS)
    assert packed.choose_skinny_rows([], [], 12) == 0
    with pytest.raises(ValueError, match="cpu_skinny_rows"):
        packed.choose_skinny_rows(weights, packs, -2)


def backend(model: Path, prepack: bool, gemm: str = "mkl", skinny_rows: int = 0) -> TorchBackend:
    """A backend with its linears packed (a start packs them after ready, in the background)."""
    b = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", num_gpu_blocks=64,
                                           cpu_weight_prepack=prepack, cpu_gemm=gemm, cpu_skinny_rows=skinny_rows))
    b.calibration.result(timeout=120)
    return b


def test_model_logits_equal_with_and_without_packed_weights(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, seed=3)
    plain, fast = backend(model, False), backend(model, True)
    linears = [m for m in fast.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1 and all(m.packed is not None and m.packed.gemm == "mkl" for m in linears)
    assert all(m.packed is None for m in plain.model.modules() if isinstance(m, Linear))
    attentions = [m for m in fast.model.modules() if isinstance(m, Attention)]
    assert attentions and all(a.ops.rope_write_kv is cpu_ops.rope_write_kv for a in attentions)  # fused on the CPU
    for kind, n, length in (("prefill", 16, 4), ("decode", 24, 20)):  # every linear (LM head too) at 16+ rows
        items = step_items(kind, n, length, 512, 2)
        logits = []
        for b in (plain, fast):
            batch = b.prepare(items)
            logits.append(b.run_batch(batch))
        assert logits[0] is not None and logits[1] is not None
        assert torch.equal(logits[0], logits[1])


@needs_onednn
def test_model_logits_over_onednn_weights_equal_up_to_rounding(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, seed=3)
    plain, fast = backend(model, False), backend(model, True, "onednn")
    assert all(m.packed is not None and m.packed.gemm == "onednn" for m in fast.model.modules()
               if isinstance(m, Linear))
    assert_logits_close(plain, fast, (("prefill", 3, 20), ("decode", 24, 20)))


@needs_skinny
def test_model_logits_through_the_skinny_kernel_equal_up_to_rounding(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, num_heads=4, vocab_size=512, seed=3)
    plain, fast = backend(model, False), backend(model, True, skinny_rows=32)
    assert all(m.packed is not None and m.packed.skinny_rows == 32 for m in fast.model.modules()
               if isinstance(m, Linear))
    assert_logits_close(plain, fast, (("prefill", 3, 4), ("decode", 24, 20)))


def assert_logits_close(plain: TorchBackend, fast: TorchBackend, steps: tuple[tuple[str, int, int], ...]) -> None:
    """Both backends' logits on each (kind, sequences, length) step equal up to rounding."""
    for kind, n, length in steps:
        items = step_items(kind, n, length, 512, 2)
        plain_logits, fast_logits = (b.run_batch(b.prepare(items)) for b in (plain, fast))
        assert plain_logits is not None and fast_logits is not None
        torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-4, atol=1e-4)


@needs_skinny
def test_the_skinny_panels_are_kept_only_where_the_skinny_kernel_is_taken() -> None:
    """The panels are one more copy of each weight: a choice of 0 skinny rows (forced, or measured where the GEMM
    wins) leaves none held; a choice of rows packs them again and dense() takes them; measuring from packs without
    panels measures over panels (as dense() will take them)."""
    from executor_service.model.calibration import apply_choice, measure_skinny_rows

    gen = torch.Generator().manual_seed(3)
    modules = [Linear(128, 256, False, torch.float32) for _ in range(2)]
    for m in modules:
        m.weight.data.copy_(torch.randn(256, 128, generator=gen))
    apply_choice(modules, packed.Packing("mkl", 0))
    assert all(m.packed is not None and m.packed.panels is not None and m.packed.skinny_panels is None
               for m in modules)
    assert measure_skinny_rows(modules, {id(m): m.packed for m in modules if m.packed is not None}, -1) >= 0
    apply_choice(modules, packed.Packing("mkl", 8))
    x = torch.randn(5, 128, generator=gen)
    for m in modules:
        assert m.packed is not None and m.packed.skinny_panels is not None
        assert torch.equal(m(x), torch.ops.pagedserve_model.skinny_panel_linear(x, m.packed.skinny_panels, 256, None))
