"""Executor start-up (#33): weights read from a memory map equal safetensors' reading, the KV cache is allocated
lazily and reads as zeros, the start-up cache is reused only under a matching key (a stale, foreign or corrupt
entry is measured again and rewritten), and the start's phases are timed."""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.forward_steps import step_items
from benchmarks.startup import evict, make_sharded_model
from executor_service import prefetch
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import ModelSpec, make_model
from executor_service.model import LlamaForCausalLM, calibration, load_model, packed
from executor_service.model.loader import MappedSafetensors
from executor_service.model.parallel import Linear, ParallelContext
from executor_service.runner.kv_cache import LAZY_MIN_BYTES, lazy_zeros
from executor_service.runner.torch_backend import TorchBackend, model_ops, startup_cache
from executor_service.startup import (
    MAX_KEYED_ENTRIES,
    MeasureCache,
    Phases,
    cpu_identity,
    fingerprint,
    process_start_time,
)


def test_mapped_tensors_equal_safetensors_reading(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(7, 5, generator=gen), "b": torch.randn(3, generator=gen).to(torch.bfloat16),
               "c": torch.randn(4, 4, generator=gen).to(torch.float16), "empty": torch.zeros(0, 3)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    mapped = MappedSafetensors.open(path)
    assert mapped is not None
    with safe_open(str(path), framework="pt") as reader:
        for name in tensors:
            view = mapped.tensor(name)
            assert view is not None and view.dtype == tensors[name].dtype
            assert torch.equal(view, reader.get_tensor(name))
    assert mapped.tensor("missing") is None


def test_a_file_that_is_not_safetensors_is_left_to_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\xff" * 8 + b"{}")
    assert MappedSafetensors.open(path) is None


def test_a_bfloat16_checkpoint_loads_as_float32_equal_to_its_values(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=1, vocab_size=512)
    path = model / "model.safetensors"
    with safe_open(str(path), framework="pt") as reader:
        reference = {name: reader.get_tensor(name).to(torch.bfloat16) for name in reader.keys()}  # noqa: SIM118
    save_file(reference, str(path))
    config = json.loads((model / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (model / "config.json").write_text(json.dumps(config))
    backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", cpu_kv_cache_space=0.01,
                                                 swap_space=0.01, startup_cache_dir=""))
    params = dict(backend.model.named_parameters())
    assert params["model.embed_tokens.weight"].dtype == torch.float32
    assert torch.equal(params["model.embed_tokens.weight"], reference["model.embed_tokens.weight"].float())
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:64], reference["model.layers.0.self_attn.q_proj.weight"].float())
    names = [name for name, _ in backend.info.startup_phases]
    assert "read+convert bfloat16->float32" in names


def test_lazy_zeros_are_zeros_and_writable() -> None:
    big = lazy_zeros((4, LAZY_MIN_BYTES // 4), torch.float32)
    small = lazy_zeros((3, 5), torch.bfloat16)
    for t in (big, small):
        assert t.is_contiguous() and not t.any()
        t[1, 2] = 7
        assert float(t.sum()) == 7


def test_phases_time_each_phase_and_the_process_start_is_in_the_past() -> None:
    phases = Phases()
    with phases.phase("read"):
        pass
    with phases.phase("pack"):
        pass
    assert list(phases.seconds) == ["read", "pack"]
    assert phases.summary().startswith("read ") and ", pack " in phases.summary()
    assert 0 < phases.total_s() < 3600
    assert abs(process_start_time() - phases.started) < 0.5  # /proc's clock ticks, computed twice


def test_measure_cache_gives_back_only_an_entry_of_the_same_key(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    cache = MeasureCache(tmp_path / "c")
    key = {"cpu": {"flags": "avx2"}, "shapes": [[64, 192]]}
    assert cache.get("packing", key) is None
    cache.put("packing", key, {"gemm": "mkl", "skinny_rows": 8})
    assert cache.get("packing", key) == {"gemm": "mkl", "skinny_rows": 8}
    with caplog.at_level(logging.INFO, "pagedserve.executor"):
        assert cache.get("packing", {**key, "cpu": {"flags": "avx512f"}}) is None
    assert "stale or foreign (cpu differ)" in caplog.text
    path = tmp_path / "c" / "packing.json"
    entry = json.loads(path.read_text())
    entry["value"]["skinny_rows"] = 64  # edited by hand: the digest no longer matches
    path.write_text(json.dumps(entry))
    assert cache.get("packing", key) is None
    path.write_text("{not json")
    assert cache.get("packing", key) is None
    assert MeasureCache(None).get("packing", key) is None


def test_measure_cache_put_says_why_an_entry_was_not_kept(tmp_path: Path) -> None:
    key, value = {"cpu": {"flags": "avx2"}}, {"gemm": "mkl"}
    assert MeasureCache(tmp_path / "c").put("packing", key, value) == ""
    (tmp_path / "file").write_text("")  # a directory that cannot be made, even by root
    assert "not written: Not a directory" in MeasureCache(tmp_path / "file" / "c").put("packing", key, value)
    assert MeasureCache(None).put("packing", key, value) == "the start-up cache is off"


def test_tensor_parallel_ranks_keep_their_own_entries_side_by_side(tmp_path: Path) -> None:
    """Two ranks measure the same shapes and choose differently (as in a smoke run: rank 0 mkl, rank 1 oneDNN): both
    entries stay, and each rank's next start reads back its own, not the other's nor a one-rank start's."""
    key = {"cpu": {"flags": "avx2"}, "shapes": [[64, 192]]}
    choices = [{"gemm": "mkl", "skinny_rows": 8}, {"gemm": "onednn", "skinny_rows": 16}]
    for rank, choice in enumerate(choices):
        MeasureCache(tmp_path, rank, 2).put("packing", key, choice)
    MeasureCache(tmp_path).put("packing", key, {"gemm": "mkl", "skinny_rows": 32})
    for rank, choice in enumerate(choices):  # the next start of each rank
        assert MeasureCache(tmp_path, rank, 2).get("packing", key) == choice
    assert MeasureCache(tmp_path).get("packing", key) == {"gemm": "mkl", "skinny_rows": 32}
    assert MeasureCache(tmp_path, 1, 4).get("packing", key) is None  # another group's rank 1 measures again
    config = ExecutorConfig(startup_cache_dir=str(tmp_path))
    cache = startup_cache(config, ParallelContext(rank=1, world_size=2))
    assert cache.get("packing", key) == choices[1]
    assert len({cache.path("packing"), startup_cache(config).path("packing")}) == 2


@pytest.mark.parametrize(("spoil", "reason"), [
    (lambda path: os.chown(path, os.geteuid() + 4321, -1), "not a regular file of this user (or root)"),
    (lambda path: os.chmod(path, 0o666), "not a regular file of this user (or root)"),
    (lambda path: os.chmod(path.parent, 0o777), "its directory may be written by other users"),
])
def test_a_measure_cache_entry_another_user_could_have_written_is_not_used(
        tmp_path: Path, spoil: Callable[[Path], None], reason: str, caplog: pytest.LogCaptureFixture) -> None:
    cache = MeasureCache(tmp_path / "c")
    key = {"cpu": {"flags": "avx2"}}
    cache.put("packing", key, {"gemm": "mkl"})
    assert cache.get("packing", key) == {"gemm": "mkl"}
    spoil(tmp_path / "c" / "packing.json")
    with caplog.at_level(logging.INFO, "pagedserve.executor"):
        assert cache.get("packing", key) is None
    assert reason in caplog.text


@pytest.mark.parametrize("contents", [
    "[" * 100_000 + "]" * 100_000,  # a RecursionError in the parser crashed the start
    json.dumps({"key": [1], "value": {}, "digest": fingerprint([1], {})}),  # a key that is no object, digest right
    json.dumps({"key": {}, "value": {}, "digest": fingerprint({}, {}), "pad": "x" * (2 << 20)}),  # 2 MB
    "[1, 2]", "\udcff\xff",
])
def test_hostile_measure_cache_contents_are_measured_again_never_a_crash(tmp_path: Path, contents: str,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "packing.json").write_bytes(contents.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.INFO, "pagedserve.executor"):
        assert MeasureCache(tmp_path).get("packing", {"cpu": {}}) is None
    assert "measuring again" in caplog.text


def backend(model: Path, cache_dir: Path) -> TorchBackend:
    return TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", cpu_kv_cache_space=0.01,
                                              swap_space=0.01, startup_cache_dir=str(cache_dir)))


def test_a_restart_takes_the_packing_choice_from_the_cache_and_a_stale_one_is_measured_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=1, vocab_size=512)
    calls: list[str] = []
    choose_gemm = packed.choose_gemm

    def counted(*args: object, **kwargs: object) -> packed.Gemm | None:
        calls.append("gemm")
        return choose_gemm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("executor_service.model.calibration.choose_gemm", counted)
    first = backend(model, tmp_path / "cache")
    path = tmp_path / "cache" / "packing.json"
    first.calibration.result(timeout=120)  # a cold start measures after ready, in the background
    assert calls == ["gemm"] and path.is_file()
    stored = json.loads(path.read_text())["value"]
    second = backend(model, tmp_path / "cache")
    assert second.calibration.done()  # nothing measured after ready
    assert calls == ["gemm"]  # not measured again
    linear = second.model.get_submodule("model.layers.0.mlp.gate_up_proj")
    assert isinstance(linear, Linear)
    assert linear.packed is not None and linear.packed.gemm == stored["gemm"]
    assert linear.packed.skinny_rows == stored["skinny_rows"]
    # Another machine's (or an older build's) entry: measured again, and the entry rewritten for this one.
    entry = json.loads(path.read_text())
    entry["key"]["cpu"] = {"model name": "another CPU", "flags": "sse2", "machine": "x86_64"}
    entry["value"] = {"gemm": "onednn" if stored["gemm"] == "mkl" else "mkl", "skinny_rows": 64}
    entry["digest"] = fingerprint(entry["key"], entry["value"])
    path.write_text(json.dumps(entry))
    third = backend(model, tmp_path / "cache")  # held: a backend dropped ends its measurement unfinished
    third.calibration.result(timeout=120)
    assert calls == ["gemm", "gemm"]
    rewritten = json.loads(path.read_text())
    assert rewritten["key"]["cpu"] == cpu_identity()  # the value is measured again: noise may change it
    assert MeasureCache(tmp_path / "cache").get("packing", rewritten["key"]) == rewritten["value"]
    assert first.info.startup_phases


def test_logits_are_the_same_with_the_choice_from_the_cache(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, vocab_size=512, init_std=0.2)
    measured = backend(model, tmp_path / "cache")
    measured.calibration.result(timeout=120)
    cached = backend(model, tmp_path / "cache")
    cached.wait_for_packing(timeout=120)  # a restart packs after ready: compare the packed passes
    for kind, n, length in (("prefill", 3, 9), ("decode", 4, 12), ("decode", 1, 5)):
        items = step_items(kind, n, length, 512, 2)
        logits = [b.run_batch(b.prepare(items)) for b in (measured, cached)]
        assert logits[0] is not None and logits[1] is not None
        assert torch.equal(logits[0], logits[1])


def test_the_start_reports_its_phases(tmp_path: Path) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=1, vocab_size=512)
    b = backend(model, tmp_path / "cache")
    names = [name for name, _ in b.info.startup_phases]
    assert names[:3] == ["interpreter+imports", "kernels", "allocate"]
    assert {"read", "pack", "kv", "tokenizer", "warm-up"} <= set(names)
    assert all(seconds >= 0 for _, seconds in b.info.startup_phases)


def test_skinny_rows_are_the_threshold_best_over_every_row_count_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[int] = []

    def seconds(weights: list[torch.Tensor], packs: list[packed.PackedWeight], rows: int) -> tuple[float, float]:
        timed.append(rows)
        return (0.5 if rows <= 8 else 2.0), 1.0  # the kernel twice as fast up to 8 rows, half as fast above

    monkeypatch.setattr(packed, "pair_seconds", seconds)
    monkeypatch.setattr(packed, "skinny_available", lambda: True)
    weight = torch.zeros(8, 16)
    assert packed.choose_skinny_rows([weight], [packed.PackedWeight("mkl", weight)]) == 8
    assert timed == list(packed.SKINNY_CALIBRATION_ROWS)


def test_one_noisy_win_at_many_rows_does_not_move_the_skinny_threshold() -> None:
    clear = {2: (0.5, 1.0), 4: (0.5, 1.0), 8: (0.6, 1.0), 16: (1.3, 1.0), 24: (1.3, 1.0), 32: (0.9, 1.0),
             64: (1.5, 1.0)}
    assert packed.skinny_threshold(clear) == 8
    assert packed.skinny_threshold(clear | {16: (0.9, 1.0)}) == 16  # 16 and 32 win, 24 loses: up to 32 would cost more
    assert packed.skinny_threshold(clear | {16: (0.9, 1.0), 24: (0.9, 1.0)}) == 32
    assert packed.skinny_threshold({2: (1.2, 1.0), 4: (0.5, 1.0), 8: (2.0, 1.0)}) == 4  # a loss at 2 alone
    assert packed.skinny_threshold({2: (1.0, 1.0), 4: (1.01, 1.0)}) == 0  # within the margin: the GEMM
    assert packed.skinny_threshold({}) == 0


def test_the_skinny_calibration_times_the_first_weights_past_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "calibration_bytes", lambda: 1000)
    weights = [torch.zeros(100) for _ in range(6)]  # 400 bytes each
    packs = [packed.PackedWeight("mkl", w) for w in weights]
    chosen, chosen_packs = packed.calibration_subset(weights, packs)
    assert len(chosen) == 3 and chosen_packs == packs[:3]


def test_a_cold_start_packs_by_the_rule_serves_and_swaps_in_what_it_measures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(tmp_path / "m", hidden_size=64, num_layers=2, vocab_size=512, init_std=0.2)
    rule = "mkl" if calibration.rule_gemm() == "onednn" else "onednn"
    monkeypatch.setattr("executor_service.model.calibration.rule_gemm", lambda: rule)  # so the swap is visible
    measured_gemm = packed.choose_gemm
    release = threading.Event()

    def held(*args: object, **kwargs: object) -> packed.Gemm | None:
        assert release.wait(timeout=120)  # the measurement waits until the provisional packing has served
        return measured_gemm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("executor_service.model.calibration.choose_gemm", held)
    cold = backend(model, tmp_path / "cache")
    linear = cold.model.get_submodule("model.layers.0.mlp.gate_up_proj")
    assert isinstance(linear, Linear) and linear.packed is not None and linear.packed.gemm == rule
    assert linear.packed.panels is None  # packed after ready, swapped in at the start of a pass
    items = step_items("decode", 4, 12, 512, 2)
    before = cold.run_batch(cold.prepare(items))
    assert not cold.calibration.done() and not (tmp_path / "cache" / "packing.json").exists()
    release.set()
    chosen = cold.calibration.result(timeout=120)
    assert json.loads((tmp_path / "cache" / "packing.json").read_text())["value"]["gemm"] == chosen.gemm
    after = cold.run_batch(cold.prepare(items))  # the packs are swapped in at the start of a pass
    assert linear.packed is not None and linear.packed.gemm == chosen.gemm and linear.packed.panels is not None
    assert before is not None and after is not None
    torch.testing.assert_close(before, after, rtol=1e-4, atol=1e-4)


def test_the_provisional_rule_takes_forced_settings_and_sizes_the_skinny_rows_by_the_caches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    linears = [Linear(64, 128, False, torch.float32) for _ in range(2)]  # 64 KiB of weights in all
    monkeypatch.setattr(calibration, "rule_gemm", lambda: "mkl")
    skinny = packed.skinny_available()
    monkeypatch.setattr(calibration, "calibration_bytes", lambda: 1 << 30)  # the weights stay in cache: no skinny
    assert calibration.provisional_choice(linears, "auto", -1) == packed.Packing("mkl", 0, provisional=True)
    monkeypatch.setattr(calibration, "calibration_bytes", lambda: 1 << 10)  # they outgrow it: the skinny kernel
    rows = calibration.PROVISIONAL_SKINNY_ROWS if skinny else 0
    assert calibration.provisional_choice(linears, "auto", -1) == packed.Packing("mkl", rows, provisional=True)
    assert calibration.provisional_choice(linears, "auto", 8).skinny_rows == (8 if skinny else 0)
    forced = calibration.provisional_choice(linears, "onednn", -1).gemm
    assert forced == ("onednn" if packed.available("onednn") else None)


def test_linears_are_packed_beside_the_reading_of_the_next_file(tmp_path: Path) -> None:
    spec = ModelSpec(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     vocab_size=512, init_std=0.2)
    model_dir = make_sharded_model(tmp_path / "m", spec, "float32", num_shards=2)
    pipeline = calibration.PackWhileReading("mkl", 0, None)
    submitted: list[int] = []

    def on_file(model: LlamaForCausalLM, filled: set[str]) -> None:
        pipeline(model, filled)
        submitted.append(len(pipeline.submitted))

    ops = model_ops(torch.device("cpu"), torch.float32)
    model = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32, ops=ops, on_file=on_file)
    linears = model.packable_linears()
    assert 0 < submitted[0] < len(linears)  # the first file's linears were packing while the second was read
    assert pipeline.finish(linears) == packed.Packing("mkl", 0)
    assert all(m.packed is not None and m.packed.gemm == "mkl" for m in linears)
    after = load_model(model_dir, device=torch.device("cpu"), dtype=torch.float32, ops=ops)
    after.pack_weights("mkl", 0)  # packed after the whole read, as before: the same packs
    for m, n in zip(linears, after.packable_linears(), strict=True):
        x = torch.randn(4, m.weight.shape[1])
        assert torch.equal(packed.dense(x, m.weight, m.bias, m.packed), packed.dense(x, n.weight, n.bias, n.packed))


def resident_share(path: Path) -> float:
    """The share of the file's pages in the page cache (mincore over a map of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as buffer:
        pages = -(-len(buffer) // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        start = ctypes.c_char.from_buffer(buffer)
        try:
            assert libc.mincore(ctypes.byref(start), ctypes.c_size_t(len(buffer)), vec) == 0
        finally:
            del start
    return sum(v & 1 for v in vec) / pages


def test_the_prefetch_reads_the_weight_files_into_the_page_cache(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(os.urandom(8 << 20))
    evict([weights])
    assert resident_share(weights) < 0.5
    thread = prefetch.prefetch_weights(str(tmp_path))
    assert thread is not None
    thread.join(timeout=60)
    assert resident_share(weights) == 1.0
    assert prefetch.prefetch_weights(str(tmp_path / "missing")) is None
    assert prefetch.prefetch_weights("") is None
    monkeypatch.setattr(prefetch, "available_bytes", lambda: 8 << 20)  # more than half the memory: left alone
    assert prefetch.prefetch_weights(str(tmp_path)) is None


def test_the_benchmarks_disk_floor_is_the_first_read_only_where_it_was_slower_than_the_host_cached_reads() -> None:
    """benchmarks/startup.py on a VM (#33): the first read after the guest's eviction is the disk's only where the
    host's cache did not hold the files (then it is well above the later reads); else the disk was not seen."""
    from benchmarks.startup import Floors
    seen = Floors([2.12, 1.26, 0.62], size=10**9)
    assert seen.first_from_disk and seen.disk == 2.12 and seen.host_cached == 0.62
    assert "2.0x the disk floor, 6.8x the host-cached floor" in seen.ratios(4.2)
    cached = Floors([0.70, 0.66, 0.62], size=10**9)
    assert not cached.first_from_disk and cached.disk is None and "not measured" in cached.describe()
    assert Floors([0.70, 0.66, 0.62], size=10**9, disk_gbps=0.4).disk == pytest.approx(2.5)


def kept_name(cache: MeasureCache, key: dict[str, Any]) -> str:
    path = cache.path("packing", key)
    assert path is not None
    return path.name


def test_models_started_in_turn_each_find_their_own_measurement(tmp_path: Path) -> None:
    """An entry replaced by another key's is kept aside under its own key (one file per key), up to MAX_KEYED_ENTRIES
    of them, the oldest dropped; a tensor-parallel rank's files are not among a single rank's."""
    cache = MeasureCache(tmp_path)
    a, b = {"shapes": [[64, 64]]}, {"shapes": [[512, 1536]]}
    cache.put("packing", a, {"gemm": "mkl"})
    cache.put("packing", b, {"gemm": "onednn"})
    assert cache.get("packing", a) == {"gemm": "mkl"} and cache.get("packing", b) == {"gemm": "onednn"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["packing.json", kept_name(cache, a)])
    cache.put("packing", a, {"gemm": "mkl", "skinny_rows": 8})  # a again: b aside, a's old file gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["packing.json", kept_name(cache, b)])
    assert cache.get("packing", a) == {"gemm": "mkl", "skinny_rows": 8}
    MeasureCache(tmp_path, 0, 2).put("packing", a, {"gemm": "mkl"})
    MeasureCache(tmp_path, 0, 2).put("packing", b, {"gemm": "mkl"})
    keys = [{"shapes": [[n, n]]} for n in range(1, 13)]
    for n, key in enumerate(keys):
        cache.put("packing", key, {"n": n})
    single = [p for p in tmp_path.iterdir() if p.name.startswith("packing.") and ".rank" not in p.name]
    assert len(single) == 1 + MAX_KEYED_ENTRIES  # the latest and the kept
    assert [cache.get("packing", key) for key in keys[-MAX_KEYED_ENTRIES - 1:]] == \
        [{"n": n} for n in range(12 - MAX_KEYED_ENTRIES - 1, 12)]
    assert cache.get("packing", keys[0]) is None and cache.get("packing", b) is None  # the oldest dropped
    assert MeasureCache(tmp_path, 0, 2).get("packing", a) == {"gemm": "mkl"}  # the rank's kept entry survives


def test_a_kept_entry_another_user_could_have_written_is_not_used(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    cache = MeasureCache(tmp_path)
    a, b = {"shapes": [[64, 64]]}, {"shapes": [[512, 1536]]}
    cache.put("packing", a, {"gemm": "mkl"})
    cache.put("packing", b, {"gemm": "onednn"})
    kept = cache.path("packing", a)
    assert kept is not None and kept.is_file()
    os.chmod(kept, 0o666)
    with caplog.at_level(logging.INFO, "pagedserve.executor"):
        assert cache.get("packing", a) is None
    assert f"{kept} not used (not a regular file of this user" in caplog.text
