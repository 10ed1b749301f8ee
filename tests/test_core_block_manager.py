"""Block manager: OK / LATER / NEVER, watermark, shared blocks and copy-on-write."""

from __future__ import annotations

from scheduler_service.core.block_manager import AllocStatus, BlockManager


def test_can_allocate_answers_ok_later_never_with_watermark() -> None:
    bm = BlockManager(num_device_blocks=10, num_cpu_blocks=0, block_size=4, watermark=0.2)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(32, 32) is AllocStatus.OK
    assert bm.can_allocate(33, 4) is AllocStatus.NEVER
    assert bm.grow("a", 24) is not None
    assert bm.can_allocate(12, 12) is AllocStatus.LATER
    assert bm.can_allocate(4, 4) is AllocStatus.OK


def test_fork_shares_blocks_and_copy_on_write_splits_the_last_one() -> None:
    bm = BlockManager(num_device_blocks=8, num_cpu_blocks=0, block_size=4)
    bm.grow("parent", 6)
    parent = list(bm.block_table("parent"))
    bm.fork("parent", "child")
    assert bm.block_table("child") == parent and bm.device.num_used == 2
    src, dst = bm.copy_on_write("child") or (None, None)
    assert src == parent[-1] and dst not in parent
    assert bm.block_table("child") == [parent[0], dst] and bm.block_table("parent") == parent
    assert bm.copy_on_write("child") is None and bm.copy_on_write("parent") is None
    bm.free("parent")
    assert bm.device.num_used == 2
    bm.free("child")
    assert bm.device.num_free == 8


def test_swap_round_trip_keeps_the_table_length() -> None:
    bm = BlockManager(num_device_blocks=4, num_cpu_blocks=4, block_size=4)
    bm.grow("a", 9)
    out = bm.swap_out("a")
    assert len(out) == 3 and bm.device.num_free == 4 and bm.cpu.num_used == 3
    back = bm.swap_in("a")
    bm.end_step()
    assert [c for c, _ in back] == [c for _, c in out] and len(bm.block_table("a")) == 3
    assert bm.cpu.num_free == 4
