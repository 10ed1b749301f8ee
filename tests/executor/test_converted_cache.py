"""The float32 form of a bfloat16 checkpoint kept on disk between starts (#33): the next start maps it, bit-equal to
torch's conversion; a stale (checkpoint changed), foreign (another CPU), truncated, replaced or corrupt cache is
converted again and rewritten, never used; one valid but out of the page cache is left alone (the checkpoint is
converted instead); the flag and the environment turn it off."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from executor_service import converted_cache, prefetch
from executor_service.config import CONVERTED_CACHE_ENV, ExecutorConfig
from executor_service.converted import ConvertedFile, ConvertedWeights
from executor_service.converted_cache import ConvertedCache, read_source


def write_checkpoint(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A bfloat16 file with every bit pattern (NaNs, ±0, ±inf), fused parts and a float32 tensor."""
    gen = torch.Generator().manual_seed(seed)
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    tensors = {
        "all": patterns.reshape(256, 256)[torch.randperm(256, generator=gen)].contiguous(),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(24, 16, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=gen).to(torch.bfloat16),
        "f32": torch.randn(5, generator=gen),
    }
    save_file(tensors, str(path))
    return tensors


def widened(path: Path, cache: ConvertedCache) -> tuple[ConvertedFile, bool]:
    """The prefetch thread's conversion of one file with `cache`, and whether it was mapped from the cache."""
    converted = ConvertedWeights()
    converted.expect([path])
    mapped = prefetch.read_files([path], converted, cache)
    result = converted.take(path)
    assert result is not None
    return result, mapped == 1


def assert_equal_to_torch(result: ConvertedFile, tensors: dict[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if tensor.dtype != torch.bfloat16:
            assert name not in result.tensors
            continue
        placed = result.tensors[name]
        got = np.frombuffer(result.arena, dtype=np.uint32, count=tensor.numel(), offset=placed.offset)
        expected = tensor.to(torch.float32).view(torch.int32).numpy().view(np.uint32).reshape(-1)
        assert np.array_equal(got, expected), name


def test_a_restart_maps_the_cached_form_bit_equal_to_torchs_conversion(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    tensors = write_checkpoint(path, seed=1)
    cache = ConvertedCache(tmp_path / "cache")
    first, hit = widened(path, cache)
    assert not hit
    assert_equal_to_torch(first, tensors)
    second, hit = widened(path, cache)
    assert hit
    assert_equal_to_torch(second, tensors)
    assert second.tensors == first.tensors and second.spans == first.spans and second.size == first.size
    assert list((tmp_path / "cache").glob(".*.tmp")) == []


def test_a_dead_writers_temporary_file_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    write_checkpoint(path, seed=6)
    cache = ConvertedCache(tmp_path / "cache")
    cache.directory.mkdir()
    stem = cache.paths(path)[0].stem
    dead = cache.directory / f".{stem}.{2**22 + 1}.abc.tmp"  # above Linux's pid_max: no such process
    live = cache.directory / f".{stem}.{os.getpid()}.def.tmp"
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    _, hit = widened(path, cache)
    assert not hit and not dead.exists() and live.exists()
    assert widened(path, cache)[1]


def entry_paths(cache: ConvertedCache, path: Path) -> tuple[Path, Path]:
    return cache.paths(path)


def spoil_truncate(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, _ = entry_paths(cache, path)
    os.truncate(data, data.stat().st_size - 64)


def spoil_contents(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same size and mtime, other bytes (a file written over in place)."""
    data, _ = entry_paths(cache, path)
    stat = data.stat()
    with open(data, "r+b") as f:
        f.write(b"\x00" * 64)
    os.utime(data, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def spoil_foreign(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another machine's CPU."""
    identity = converted_cache.cpu_identity()
    monkeypatch.setattr(converted_cache, "cpu_identity", lambda: {**identity, "flags": "other"})


def spoil_meta(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The .json edited by hand (its digest no longer matches)."""
    _, meta = entry_paths(cache, path)
    entry = json.loads(meta.read_text())
    entry["data"]["size"] += 4
    meta.write_text(json.dumps(entry))


def spoil_missing(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry_paths(cache, path)[0].unlink()


def spoil_owner(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The .json another user's (one who could have planted it with a key that matches)."""
    os.chown(entry_paths(cache, path)[1], os.geteuid() + 4321, -1)


def spoil_link(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data file a link to a copy of itself (a link can point anywhere its maker likes)."""
    data, _ = entry_paths(cache, path)
    copy = data.with_name("elsewhere")
    copy.write_bytes(data.read_bytes())
    stat = data.stat()
    data.unlink()
    data.symlink_to(copy)
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def spoil_nested(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The .json replaced by JSON nested too deeply for the parser (its RecursionError crashed the start)."""
    entry_paths(cache, path)[1].write_text("[" * 100_000 + "]" * 100_000)


def spoil_huge(cache: ConvertedCache, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The .json padded past any entry's size (never read whole)."""
    _, meta = entry_paths(cache, path)
    entry = json.loads(meta.read_text())
    meta.write_text(json.dumps({**entry, "pad": "x" * (2 << 20)}))


@pytest.mark.parametrize(("spoil", "reason"), [
    (spoil_truncate, "truncated"), (spoil_contents, "contents changed"), (spoil_foreign, "stale or foreign: cpu"),
    (spoil_meta, "corrupt"), (spoil_missing, "data file missing"), (spoil_nested, "unreadable"),
    (spoil_huge, "unreadable"), (spoil_owner, "not a regular file of this user (or root)"),
    (spoil_link, "not a regular file of this user (or root)")])
def test_a_spoiled_cache_is_converted_again_and_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture, spoil: object,
                                                          reason: str) -> None:
    path = tmp_path / "w.safetensors"
    tensors = write_checkpoint(path, seed=2)
    cache = ConvertedCache(tmp_path / "cache")
    widened(path, cache)
    spoil(cache, path, monkeypatch)  # type: ignore[operator]
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        again, hit = widened(path, cache)
    assert not hit and reason in caplog.text
    assert_equal_to_torch(again, tensors)
    third, hit = widened(path, cache)  # rewritten: the next start maps it
    assert hit
    assert_equal_to_torch(third, tensors)


def test_a_cache_directory_every_user_may_write_is_not_trusted_unless_sticky(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone could have planted an entry whose key matches there (the key is made of what anyone may read); in a
    sticky directory (as /tmp) nobody else can replace this user's files."""
    path = tmp_path / "w.safetensors"
    tensors = write_checkpoint(path, seed=2)
    cache = ConvertedCache(tmp_path / "cache")
    widened(path, cache)
    os.chmod(cache.directory, 0o777)
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        again, hit = widened(path, cache)
    assert not hit and "its directory may be written by other users" in caplog.text
    assert_equal_to_torch(again, tensors)
    os.chmod(cache.directory, 0o1777)
    assert widened(path, cache)[1]


def test_a_changed_checkpoint_is_converted_again_never_served_from_the_old_cache(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "w.safetensors"
    write_checkpoint(path, seed=3)
    cache = ConvertedCache(tmp_path / "cache")
    widened(path, cache)
    newer = write_checkpoint(path, seed=4)  # the same names and shapes: the same size and header
    with caplog.at_level(logging.INFO, logger="pagedserve.executor"):
        again, hit = widened(path, cache)
    assert not hit and "stale or foreign: " in caplog.text and "mtime_ns" in caplog.text
    assert_equal_to_torch(again, newer)
    with open(path, "rb") as f:
        source = read_source(f, path, path.stat().st_size)
    assert source is not None and cache.load(source).converted is not None  # rewritten for the new one


def test_a_valid_cache_out_of_the_page_cache_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading 2x the bytes from the disk would be slower than reading the checkpoint: it is converted instead, and
    the valid entry is not rewritten."""
    path = tmp_path / "w.safetensors"
    tensors = write_checkpoint(path, seed=5)
    cache = ConvertedCache(tmp_path / "cache")
    widened(path, cache)
    data, _ = cache.paths(path)
    mtime = data.stat().st_mtime_ns
    monkeypatch.setattr(converted_cache, "resident_share", lambda buffer: 0.0)
    again, hit = widened(path, cache)
    assert not hit
    assert_equal_to_torch(again, tensors)
    assert data.stat().st_mtime_ns == mtime


def test_the_cache_sits_in_the_startup_cache_directory_and_can_be_turned_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONVERTED_CACHE_ENV, raising=False)
    cache = prefetch.cache_for(ExecutorConfig(model="m", startup_cache_dir=str(tmp_path)))
    assert cache is not None and cache.directory == tmp_path / "converted"
    assert prefetch.cache_for(ExecutorConfig(model="m", startup_cache_dir="")) is None
    assert prefetch.cache_for(ExecutorConfig(model="m", converted_weights_cache=False)) is None
    monkeypatch.setenv(CONVERTED_CACHE_ENV, "0")
    args = ["--model", "m", "--startup-cache-dir", str(tmp_path)]
    assert prefetch.cache_for(ExecutorConfig.from_args(args)) is None


def test_only_a_thread_writing_the_cache_is_waited_for_at_exit(tmp_path: Path) -> None:
    """A prefetch thread still reading (an executor stopped while loading) is not joined; one writing is."""

    class Recorded(threading.Thread):
        joins: list[float | None] = []

        def join(self, timeout: float | None = None) -> None:
            self.joins.append(timeout)
            super().join(timeout)

    cache = ConvertedCache(tmp_path / "cache")
    release = threading.Event()
    busy = Recorded(target=release.wait, daemon=True)
    busy.start()
    prefetch.finish_prefetch(busy, cache, timeout_s=60)  # not writing: not waited for
    assert busy.joins == [] and busy.is_alive()
    cache.writing.set()
    release.set()
    prefetch.finish_prefetch(busy, cache, timeout_s=60)
    assert busy.joins == [60] and not busy.is_alive()
