"""Paged KV block accounting over a device pool and a CPU swap pool."""

from __future__ import annotations

import enum
from collections import deque


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._ref_counts[i] = 1
        return ids

    def share(self, block_id: int) -> None:
        self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free(self, ids: list[int]) -> None:
        for i in ids:
            self._ref_counts[i] -= 1
            if self._ref_counts[i] == 0:
                self._free.append(i)


class BlockManager:
    """Owns every block table. A table covers a request's tokens on one pool at a time."""

    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_device_blocks)
        self._device_tables: dict[str, list[int]] = {}
        self._cpu_tables: dict[str, list[int]] = {}
        self._cpu_released_this_step: list[int] = []

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._device_tables.get(request_id, [])

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._device_tables.get(request_id, ())) + len(self._cpu_tables.get(request_id, ()))

    def can_allocate(self, total_tokens: int, tokens_now: int) -> AllocStatus:
        if self.blocks_for(max(total_tokens, tokens_now)) > self.device.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.device.num_free - self.blocks_for(tokens_now) < self.watermark_blocks:
            return AllocStatus.LATER
        return AllocStatus.OK

    def slots_missing(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self._device_tables.get(request_id, ())))

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self.slots_missing(request_id, num_tokens) <= self.device.num_free

    def grow(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Extend the device table to hold num_tokens; the new block ids, or None if the pool is short."""
        new = self.device.allocate(self.slots_missing(request_id, num_tokens))
        if new is not None:
            self._device_tables.setdefault(request_id, []).extend(new)
        return new

    def release_tail(self, request_id: str, num_blocks: int) -> None:
        """Give back the last num_blocks of a table (blocks granted this step that hold no data)."""
        table = self._device_tables.get(request_id)
        if table and num_blocks > 0:
            self.device.free(table[-num_blocks:])
            del table[-num_blocks:]

    def fork(self, parent_id: str, child_id: str) -> None:
        table = self._device_tables[parent_id]
        for block_id in table:
            self.device.share(block_id)
        self._device_tables[child_id] = list(table)

    def copy_on_write(self, request_id: str) -> tuple[int, int] | None:
        """Give the request its own copy of a shared last block; the (src, dst) copy, or None."""
        table = self._device_tables.get(request_id)
        if not table or self.device.ref_count(table[-1]) == 1:
            return None
        new = self.device.allocate(1)
        if new is None:
            return None
        src = table[-1]
        self.device.free([src])
        table[-1] = new[0]
        return src, new[0]

    def free(self, request_id: str) -> None:
        self.device.free(self._device_tables.pop(request_id, []))
        self.cpu.free(self._cpu_tables.pop(request_id, []))

    def can_swap_out(self, request_id: str) -> bool:
        return len(self._device_tables.get(request_id, ())) <= self.cpu.num_free

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        device_ids = self._device_tables.pop(request_id, [])
        cpu_ids = self.cpu.allocate(len(device_ids))
        if cpu_ids is None:
            raise RuntimeError(f"swap pool short for {request_id}: call can_swap_out first")
        self.device.free(device_ids)
        self._cpu_tables[request_id] = cpu_ids
        return list(zip(device_ids, cpu_ids, strict=True))

    def can_swap_in(self, request_id: str, extra_tokens_blocks: int = 0) -> bool:
        need = len(self._cpu_tables.get(request_id, ())) + extra_tokens_blocks
        return self.device.num_free - need >= self.watermark_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        cpu_ids = self._cpu_tables.pop(request_id, [])
        device_ids = self.device.allocate(len(cpu_ids))
        if device_ids is None:
            raise RuntimeError(f"device pool short for {request_id}: call can_swap_in first")
        self._cpu_released_this_step.extend(cpu_ids)
        self._device_tables[request_id] = device_ids
        return list(zip(cpu_ids, device_ids, strict=True))

    def end_step(self) -> None:
        """Swap blocks read by this step's swap-in become free only now, so no mapping in one step
        reads a block another mapping of the same step writes."""
        self.cpu.free(self._cpu_released_this_step)
        self._cpu_released_this_step = []
