"""Two ranks for tests/executor/test_tensor_parallel.py: rank 0 sends what `channel_messages` lists over a
StepChannel on a gloo group, rank 1 receives it and puts what arrived on a queue."""

from __future__ import annotations

from datetime import timedelta
from multiprocessing.queues import Queue
from typing import Any

import torch
import torch.distributed as dist

from executor_service.model import AttentionMetadata, ParallelContext
from executor_service.parallel.channel import Op, StepChannel, strip_tensors
from executor_service.runner.torch_backend import Batch


def make_batch(num_tokens: int) -> Batch:
    """A batch whose fields are distinguishable by value; large enough for several frames when asked."""
    ids = torch.arange(num_tokens, dtype=torch.long)
    meta = AttentionMetadata(slot_mapping=ids * 3, block_tables=torch.arange(12, dtype=torch.int32).view(3, 4),
                             seq_lens=torch.tensor([5, 6, 7], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, 1, 2, num_tokens], dtype=torch.int32))
    return Batch(ids + 7, ids * 2, meta, torch.tensor([0, 1, num_tokens - 1]), [0, 1, 2], False)


def channel_messages() -> list[tuple[Op, list[tuple[int, int]], Batch | None]]:
    return [(Op.SWAP_OUT, [(1, 2), (3, 4)], None), (Op.EXECUTE, [], make_batch(5)),
            (Op.EXECUTE, [], make_batch(20_000)), (Op.HEARTBEAT, [], None), (Op.COPY, [(0, 9)], None),
            (Op.STOP, [], None)]


def flatten(batch: Batch | None) -> list[list[Any]] | None:
    if batch is None:
        return None
    tensors: list[torch.Tensor] = []
    strip_tensors(batch, tensors)
    return [[str(t.dtype), list(t.shape), t.flatten().tolist()] for t in tensors] + [list(batch.sample_items)]


def channel_peer(rank: int, port: int, out: Queue) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    channel = StepChannel(ParallelContext(rank, 2, dist.group.WORLD), dist.group.WORLD, torch.device("cpu"))  # type: ignore[arg-type]
    try:
        if rank == 0:
            for op, mapping, batch in channel_messages():
                channel.send(op, mapping, batch)
            return
        while True:
            message = channel.receive()
            out.put((message.op, message.mapping, flatten(message.batch)))
            if message.op is Op.STOP:
                return
    finally:
        dist.destroy_process_group()
