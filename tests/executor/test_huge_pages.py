"""--cpu-huge-pages (#29): the KV cache's map comes in transparent huge pages, and --no-cpu-huge-pages leaves it in
4 KiB pages. Each check reads the kernel's own account of the mapping (/proc/self/smaps), so it fails if the pages
are not huge, whatever the code asked for."""

from __future__ import annotations

import ctypes
import errno
import mmap
from pathlib import Path

import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.runner import kv_cache
from executor_service.runner.kv_cache import HUGE_PAGE, CacheShape, KVCache, lazy_zeros

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's transparent_hugepage setting: always, madvise or never ('' where there is none)."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.index("[") + 1:text.index("]")] if "[" in text else ""


needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                               reason="this kernel gives no transparent huge pages on madvise")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_the_flags_default_on() -> None:
    assert ExecutorConfig.from_args([]).cpu_huge_pages and ExecutorConfig.from_args([]).cpu_populate_kv
    assert not ExecutorConfig.from_args(["--no-cpu-huge-pages"]).cpu_huge_pages
    assert not ExecutorConfig.from_args(["--no-cpu-populate-kv"]).cpu_populate_kv


@needs_thp
def test_a_huge_page_kv_map_is_aligned_zero_and_backed_by_huge_pages() -> None:
    dims = (2, 2, 256, 16, 4, 64)  # 16 MiB: layers, K/V, blocks, block size, KV heads, head size
    cache = lazy_zeros(dims, torch.float32, huge_pages=True)
    assert cache.data_ptr() % HUGE_PAGE == 0 and cache.is_contiguous() and tuple(cache.shape) == dims
    assert huge_bytes_at(cache.data_ptr()) == 0  # nothing is touched yet: lazy still
    cache.fill_(1.0)
    assert float(cache.sum()) == cache.numel()
    assert huge_bytes_at(cache.data_ptr()) >= 4 * HUGE_PAGE  # of 8 (a fragmented machine may fall back for some)
    plain = lazy_zeros(dims, torch.float32)
    plain.fill_(1.0)
    if thp_mode() == "madvise":
        assert huge_bytes_at(plain.data_ptr()) == 0


@needs_thp
def test_the_kv_cache_takes_the_setting_for_its_blocks_and_its_swap_area() -> None:
    shape = CacheShape(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = KVCache(shape, num_device_blocks=256, num_swap_blocks=128, device=torch.device("cpu"), huge_pages=True)
    for kv in (cache.device_kv, cache.swap_kv):
        kv.fill_(2.0)
        assert kv.data_ptr() % HUGE_PAGE == 0 and huge_bytes_at(kv.data_ptr()) >= HUGE_PAGE


class RefusingMap(mmap.mmap):
    """A map on a kernel built without transparent huge pages: madvise(MADV_HUGEPAGE) fails with EINVAL."""

    def madvise(self, option: int, start: int = 0, length: int = 0) -> None:
        if option == mmap.MADV_HUGEPAGE:
            raise OSError(errno.EINVAL, "Invalid argument")
        super().madvise(option, start, length)


def test_a_kernel_without_huge_pages_leaves_the_cache_in_small_pages_and_usable(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kv_cache.mmap, "mmap", RefusingMap)
    shape = CacheShape(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = KVCache(shape, num_device_blocks=256, num_swap_blocks=128, device=torch.device("cpu"), huge_pages=True)
    for kv in (cache.device_kv, cache.swap_kv):
        assert float(kv.abs().sum()) == 0.0
        kv.fill_(3.0)
        assert float(kv.sum()) == 3.0 * kv.numel()
    assert "no transparent huge pages" in caplog.text


def populate_works() -> bool:
    """Whether this kernel has MADV_POPULATE_WRITE (Linux 5.14)."""
    probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        probe.madvise(kv_cache.MADV_POPULATE_WRITE)
    except OSError:
        return False
    finally:
        probe.close()
    return True


needs_populate = pytest.mark.skipif(not populate_works(), reason="no MADV_POPULATE_WRITE before Linux 5.14")


def resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's pages in memory (mincore over exactly its range, whatever maps lie beside it)."""
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    pages = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size() - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


@needs_populate
@pytest.mark.parametrize("huge", [False, True])
def test_populate_faults_every_page_in_and_keeps_what_was_written(huge: bool) -> None:
    cache = lazy_zeros((2, 2, 256, 16, 4, 64), torch.float32, huge_pages=huge)  # 16 MiB
    size = cache.numel() * cache.element_size()
    cache[1, 0, 7].fill_(5.0)
    pauses: list[int] = []
    done = kv_cache.populate(cache, lambda: pauses.append(resident_bytes(cache)), chunk=4 << 20)
    assert done == size and len(pauses) == 4  # a pause before each 4 MiB chunk
    assert pauses[0] < size // 2 and pauses == sorted(pauses) and pauses[-1] < size  # lazy until populated
    assert resident_bytes(cache) == size
    assert float(cache[1, 0, 7].sum()) == 5.0 * cache[1, 0, 7].numel()
    assert float(cache.sum()) == 5.0 * cache[1, 0, 7].numel()  # the rest still zero


def test_populate_on_a_kernel_without_it_does_nothing_and_says_so(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kv_cache, "MADV_POPULATE_WRITE", 0x7fff)  # no such advice: EINVAL, as before Linux 5.14
    cache = lazy_zeros((4, 1 << 18), torch.float32)
    assert kv_cache.populate(cache) == 0
    assert "faulted in as steps first write them (madvise: EINVAL)" in caplog.text
    cache.fill_(1.0)
    assert float(cache.sum()) == cache.numel()


@needs_populate
def test_a_cache_larger_than_the_memory_left_stays_lazy(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    cache = lazy_zeros((4, 1 << 18), torch.float32)  # 4 MiB
    monkeypatch.setattr(kv_cache, "available_bytes", lambda: 3 << 20)
    assert kv_cache.populate(cache) == 0 and resident_bytes(cache) < cache.numel() * cache.element_size()
    assert "exceed the 3 MiB of memory left" in caplog.text
    with pytest.raises(ValueError, match="contiguous"):
        kv_cache.populate(cache[:, :100])


@needs_populate
def test_the_executor_faults_the_cache_in_only_while_no_step_is_in_flight(
        caplog: pytest.LogCaptureFixture) -> None:
    from executor_service.__main__ import populate_in_background
    from executor_service.activity import StepActivity

    shape = CacheShape(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype=torch.float32)
    cache = KVCache(shape, num_device_blocks=512, num_swap_blocks=0, device=torch.device("cpu"))  # 32 MiB
    size = cache.device_kv.numel() * cache.device_kv.element_size()

    class CpuBackend:  # what populate_in_background reads of a TorchBackend: its device and the hook
        info = type("Info", (), {"device": "cpu"})()
        populate_kv_cache = staticmethod(cache.populate)

    activity = StepActivity(quiet_s=0.01)
    caplog.set_level("INFO", logger="pagedserve.executor")
    with activity.step():
        thread = populate_in_background(CpuBackend(), activity)  # type: ignore[arg-type]
        assert thread is not None
        for _ in range(1000):  # until the thread waits for the step (at most ~10 s)
            if activity.waiting:
                break
            thread.join(timeout=0.01)
        assert activity.waiting == 1 and resident_bytes(cache.device_kv) < size // 2
    thread.join(timeout=60)
    assert not thread.is_alive() and resident_bytes(cache.device_kv) == size
    assert f"KV cache: {size >> 20} MiB of pages faulted in after ready" in caplog.text
