"""A restart packs its linears after ready (#33, runner/background_packing.py): the backend comes up with the start-up
cache's choice over unpacked weights; passes of 1 row and up to the skinny kernel's rows run on them (the same
kernels as after the packing), the packs are made on a background thread and swapped in at the start of the next
pass, never within one, and a pass of more rows packs what is left itself first."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.forward_steps import step_items
from executor_service.backend import BatchItem
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.model import packed
from executor_service.model.parallel import Linear
from executor_service.runner.background_packing import BackgroundPacking
from executor_service.runner.torch_backend import TorchBackend
from tests.support.background_threads import background_threads


def backend(model: Path, cache_dir: Path, **settings: Any) -> TorchBackend:
    return TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", cpu_kv_cache_space=0.01,
                                              swap_space=0.01, startup_cache_dir=str(cache_dir), **settings))


def first_start(model: Path, cache_dir: Path, **settings: Any) -> None:
    """A start that measures the packing choice and keeps it in the cache (packing before ready, so that `hold`
    does not hold it)."""
    backend(model, cache_dir, cpu_pack_after_ready=False, **settings).wait_for_packing(timeout=120)
    assert (cache_dir / "packing.json").is_file()


def linears(b: TorchBackend) -> list[Linear]:
    return [m for m in b.model.modules() if isinstance(m, Linear)]


def logits(b: TorchBackend, items: list[BatchItem]) -> torch.Tensor:
    out = b.run_batch(b.prepare(items))
    assert out is not None
    return out


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return make_model(tmp_path / "m", hidden_size=64, num_layers=2, vocab_size=512, init_std=0.2)


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The background packing thread starts only once this event is set (so the passes before it surely find the
    weights unpacked, and what gets packed meanwhile is packed by the passes themselves)."""
    release = threading.Event()

    def held() -> None:
        assert release.wait(timeout=120)

    monkeypatch.setattr("executor_service.runner.background_packing.lower_thread_priority", held)
    return release


def test_a_pass_over_the_skinny_rows_packs_what_is_left_first(model: Path, tmp_path: Path,
                                                              hold: threading.Event) -> None:
    cache = tmp_path / "cache"  # no skinny kernel: every pass of 2+ rows wants the packed GEMM
    first_start(model, cache, cpu_skinny_rows=0)
    plain = backend(model, cache, cpu_weight_prepack=False)
    warm = backend(model, cache, cpu_skinny_rows=0)
    assert warm.packing_after_ready is not None
    chosen = {(m.packed.gemm, m.packed.skinny_rows) for m in linears(warm) if m.packed is not None}
    assert len(chosen) == 1 and all(m.packed is not None and m.packed.panels is None for m in linears(warm))
    one_row = step_items("decode", 1, 9, 512, 2)  # F.linear, packed or not: packs nothing
    assert torch.equal(logits(warm, one_row), logits(plain, one_row))
    assert all(m.packed is not None and m.packed.panels is None for m in linears(warm))
    wide = step_items("prefill", 4, 20, 512, 2)  # 80 rows: packed first, on this thread (the background one waits)
    torch.testing.assert_close(logits(warm, wide), logits(plain, wide), rtol=1e-4, atol=1e-4)
    assert not hold.is_set()  # the background thread has not begun: this pass packed every linear
    assert all(m.packed is not None and m.packed.panels is not None for m in linears(warm))
    assert {(m.packed.gemm, m.packed.skinny_rows) for m in linears(warm) if m.packed is not None} == chosen
    hold.set()
    warm.wait_for_packing(timeout=120)  # the background thread finds nothing left to pack
    assert warm.packing_after_ready is None


def test_small_batches_run_unpacked_and_the_packs_come_in_at_the_next_pass(
        model: Path, tmp_path: Path, hold: threading.Event) -> None:
    rows = 8 if packed.skinny_available() else 0
    first_start(model, tmp_path / "cache", cpu_skinny_rows=rows)
    warm = backend(model, tmp_path / "cache", cpu_skinny_rows=rows)
    steps = [step_items("decode", 1, 9, 512, 2)]  # one row: F.linear, packed or not
    if packed.skinny_available():
        steps.append(step_items("decode", 4, 9, 512, 2))  # 4 rows: the skinny kernel, packed or not
    before = [logits(warm, items) for items in steps]
    assert all(m.packed is not None and m.packed.panels is None for m in linears(warm))
    hold.set()
    assert warm.packing_after_ready is not None
    warm.packing_after_ready.done.result(timeout=120)
    assert all(m.packed is not None and m.packed.panels is None for m in linears(warm))  # packed, not yet swapped
    after = [logits(warm, items) for items in steps]  # swapped in at the start of the first of these passes
    assert warm.packing_after_ready is None
    assert all(m.packed is not None and m.packed.panels is not None for m in linears(warm))
    for first, second in zip(before, after, strict=True):
        assert torch.equal(first, second)


def test_without_pack_after_ready_a_restart_packs_before_ready(model: Path, tmp_path: Path) -> None:
    first_start(model, tmp_path / "cache")
    warm = backend(model, tmp_path / "cache", cpu_pack_after_ready=False)
    assert warm.packing_after_ready is None
    assert all(m.packed is not None and m.packed.panels is not None for m in linears(warm))


@pytest.mark.parametrize("pack_after_ready", [True, False])
def test_a_choice_the_cache_could_not_keep_is_logged_as_not_kept(model: Path, tmp_path: Path, pack_after_ready: bool,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A cold start whose start-up cache directory cannot be written (here: its parent is a file, which stops root
    too) says so, with the reason, where it logged "kept for the next start" regardless."""
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.INFO, "pagedserve.executor"):
        backend(model, tmp_path / "file" / "cache", cpu_pack_after_ready=pack_after_ready).wait_for_packing(120)
    assert "not kept: start-up cache" in caplog.text and "Not a directory" in caplog.text
    assert "kept for the next start" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, "pagedserve.executor"):  # a writable one: kept, and says so
        backend(model, tmp_path / "cache", cpu_pack_after_ready=pack_after_ready).wait_for_packing(120)
    assert "kept for the next start" in caplog.text and "not kept" not in caplog.text
    assert (tmp_path / "cache" / "packing.json").is_file()


@pytest.mark.skipif(not packed.skinny_available(), reason="the skinny kernel needs AVX-512 or AVX2")
@pytest.mark.parametrize("skinny_rows", [0, 8])
def test_packs_made_after_ready_hold_skinny_panels_only_where_the_skinny_kernel_is_taken(
        model: Path, tmp_path: Path, skinny_rows: int) -> None:
    """The panels are one more copy of each weight: a restart packing after ready with a kept choice of 0 skinny
    rows leaves no linear holding them (one of 8 rows keeps them)."""
    import json

    from executor_service.startup import fingerprint

    first_start(model, tmp_path, cpu_gemm="mkl")
    entry = json.loads((tmp_path / "packing.json").read_text())
    entry["value"]["skinny_rows"] = skinny_rows  # the choice as if measured so on this machine
    entry["digest"] = fingerprint(entry["key"], entry["value"])
    (tmp_path / "packing.json").write_text(json.dumps(entry, sort_keys=True))
    b = backend(model, tmp_path, cpu_gemm="mkl", cpu_pack_after_ready=True)
    assert b.packing_after_ready is not None
    assert b.packing_after_ready.packing.cached, "the restart measured again instead of taking the kept choice"
    b.wait_for_packing(timeout=120)
    packs = [m.packed for m in linears(b) if packed.can_skinny(m.weight)]
    assert packs and all(p is not None and p.panels is not None for p in packs)
    assert all((p.skinny_panels is not None) == (skinny_rows > 0) for p in packs if p is not None)


@pytest.mark.parametrize("pack_after_ready", [False, True])
def test_a_choice_measured_after_the_thread_count_changed_on_another_thread_is_found_by_the_next_start(
        model: Path, tmp_path: Path, pack_after_ready: bool) -> None:
    """A thread takes torch's process-wide thread count at its first torch call and keeps it; set on another thread
    afterwards, the count differs between the loading thread and a background thread started later. The first
    start measures on such a thread (start_calibration, or BackgroundPacking after ready) and keys the choice with
    the loading thread's count, which is what the next start looks up."""
    before = torch.get_num_threads()  # this thread's count, taken long ago
    setter = threading.Thread(target=torch.set_num_threads, args=(before + 1,))  # new threads now take before + 1
    setter.start()
    setter.join()
    try:
        first = backend(model, tmp_path, cpu_pack_after_ready=pack_after_ready)
        first.wait_for_packing(timeout=120)
        assert (tmp_path / "packing.json").is_file()
        again = backend(model, tmp_path, cpu_pack_after_ready=True)
        assert again.packing_after_ready is not None and again.packing_after_ready.packing.cached
        again.wait_for_packing(timeout=120)
    finally:
        torch.set_num_threads(before)


def test_the_test_process_waits_for_the_packing_thread_before_it_exits(model: Path, tmp_path: Path,
                                                                          hold: threading.Event) -> None:
    """tests/support/background_threads.py joins the packing thread at the session's end (a process finalizing
    while it runs a torch op aborts): the thread must be one it knows by name."""
    first_start(model, tmp_path / "cache")
    warm = backend(model, tmp_path / "cache")
    assert warm.packing_after_ready is not None
    assert [t.name for t in background_threads()] == ["pack-after-ready"]
    hold.set()
    warm.packing_after_ready.done.result(timeout=120)


def warm_start(model: Path, cache_dir: Path, **settings: Any) -> tuple[TorchBackend, BackgroundPacking,
                                                                       threading.Thread]:
    """A restart that packs after ready (the cache measured by a first start), its packing and the thread it
    started for it (not any other packing thread still alive in this process)."""
    first_start(model, cache_dir)
    others = background_threads()
    warm = backend(model, cache_dir, **settings)
    assert warm.packing_after_ready is not None
    [thread] = [t for t in background_threads() if t not in others]
    return warm, warm.packing_after_ready, thread


def test_closing_the_backend_ends_its_packing_thread_before_it_packs_more(model: Path, tmp_path: Path,
                                                                           hold: threading.Event) -> None:
    warm, packing, thread = warm_start(model, tmp_path / "cache")
    warm.close()
    hold.set()
    with pytest.raises(CancelledError):
        packing.done.result(timeout=120)
    thread.join(timeout=120)
    assert not thread.is_alive() and not packing.latest  # stopped before its first pack
    wide = step_items("prefill", 4, 20, 512, 2)  # a pass that would have packed the rest first: runs on F.linear
    assert warm.execute(wide)[-1] is not None and not packing.latest


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_backend_dropped_unclosed_ends_its_packing_thread(model: Path, tmp_path: Path, hold: threading.Event,
                                                            with_draft: bool) -> None:
    warm, packing, thread = warm_start(model, tmp_path / "cache", **({"draft_model": str(model)} if with_draft else {}))
    assert (warm.draft is not None) == with_draft
    del warm  # no cycle holds it: freed at once
    assert packing.stopping
    hold.set()
    with pytest.raises(CancelledError):
        packing.done.result(timeout=120)
    thread.join(timeout=120)
    assert not thread.is_alive() and not packing.latest
