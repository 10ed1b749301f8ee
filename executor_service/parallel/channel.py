"""The step channel: rank 0 broadcasts every backend call (a forward pass, a swap, a copy) to the other
ranks as one message (the op and its block pairs, or the batch with its tensors packed into one buffer),
in order, in fixed-size frames."""

from __future__ import annotations

import enum
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from executor_service.backend import BlockMap
from executor_service.model import ParallelContext
from executor_service.runner.torch_backend import Batch

ALIGN = 16
HEADER_BYTES = 16  # two int64: pickled Message length, frame length
FRAME_BYTES = 1 << 16


class Op(enum.Enum):
    EXECUTE = 1
    SWAP_OUT = 2
    SWAP_IN = 3
    COPY = 4
    HEARTBEAT = 5
    STOP = 6


@dataclass(slots=True, frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


@dataclass(slots=True)
class Message:
    """One backend call as rank 0 broadcasts it; a batch travels with TensorSpecs in place of tensors."""

    op: Op
    mapping: BlockMap = field(default_factory=list)
    batch: Any = None


class StepChannel:
    """Rank 0 to every rank, in order, one frame per backend call: a fixed-size byte buffer broadcast over
    the control group holding the pickled Message and, on the CPU, the batch's tensors (a larger call
    sends the rest in a second broadcast). On CUDA the tensors follow as one buffer over the world group.
    One collective per call on the CPU: broadcast_object_list would cost two plus its own overhead."""

    def __init__(self, parallel: ParallelContext, control: dist.ProcessGroup, device: torch.device) -> None:
        self.parallel = parallel
        self.control = control
        self.device = device
        self.inline = device.type == "cpu"
        self._frame = torch.empty(FRAME_BYTES, dtype=torch.uint8)

    def send(self, op: Op, mapping: BlockMap | None = None, batch: Batch | None = None) -> None:
        tensors: list[Tensor] = []
        skeleton = None if batch is None else strip_tensors(batch, tensors)
        meta = pickle.dumps(Message(op, list(mapping or ()), skeleton), protocol=pickle.HIGHEST_PROTOCOL)
        data = pack(tensors, self.device) if tensors else None
        body = HEADER_BYTES + aligned(len(meta))
        total = body + (data.numel() if data is not None and self.inline else 0)
        frame = torch.empty(max(FRAME_BYTES, total), dtype=torch.uint8)
        frame[:HEADER_BYTES].view(torch.int64).copy_(torch.tensor([len(meta), total]))
        frame[HEADER_BYTES : HEADER_BYTES + len(meta)].copy_(torch.frombuffer(bytearray(meta), dtype=torch.uint8))
        if data is not None and self.inline:
            frame[body:total].copy_(data)
        dist.broadcast(frame[:FRAME_BYTES], src=0, group=self.control)
        if total > FRAME_BYTES:
            dist.broadcast(frame[FRAME_BYTES:total], src=0, group=self.control)
        if data is not None and not self.inline:
            dist.broadcast(data, src=0, group=self.parallel.group)

    def answer_heartbeat(self) -> None:
        """Every rank meets here after a heartbeat: a peer that hangs (not only one that died) is found
        within the collective timeout even while the executor is idle."""
        dist.barrier(group=self.control)

    def receive(self) -> Message:
        frame = self._frame
        dist.broadcast(frame, src=0, group=self.control)
        meta_len, total = frame[:HEADER_BYTES].view(torch.int64).tolist()
        if total > FRAME_BYTES:
            frame = torch.cat([frame, torch.empty(total - FRAME_BYTES, dtype=torch.uint8)])
            dist.broadcast(frame[FRAME_BYTES:], src=0, group=self.control)
        message: Message = pickle.loads(frame[HEADER_BYTES : HEADER_BYTES + meta_len].numpy().tobytes())
        if message.batch is not None:
            specs: list[TensorSpec] = []
            collect_specs(message.batch, specs)
            if self.inline:
                data = frame[HEADER_BYTES + aligned(meta_len) : total].clone()
            else:
                data = torch.empty(sum(aligned(s.nbytes) for s in specs), dtype=torch.uint8, device=self.device)
                dist.broadcast(data, src=0, group=self.parallel.group)
            message.batch = fill_tensors(message.batch, iter(unpack(data, specs)))
        return message


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack(tensors: list[Tensor], device: torch.device) -> Tensor:
    buffer = torch.empty(sum(aligned(t.nbytes) for t in tensors), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        buffer[offset : offset + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
        offset += aligned(t.nbytes)
    return buffer


def unpack(buffer: Tensor, specs: list[TensorSpec]) -> list[Tensor]:
    out, offset = [], 0
    for spec in specs:
        out.append(buffer[offset : offset + spec.nbytes].view(spec.dtype).view(spec.shape))
        offset += aligned(spec.nbytes)
    return out


def is_container(obj: Any) -> bool:
    return isinstance(obj, list | tuple) and bool(obj) and not isinstance(obj[0], int | float | str)


def map_leaves(obj: Any, is_leaf: Callable[[Any], bool], fn: Callable[[Any], Any]) -> Any:
    """A copy of obj (dataclasses, dicts, lists, tuples, nested) with fn applied to each leaf, in order."""
    if is_leaf(obj):
        return fn(obj)
    if is_dataclass(obj) and not isinstance(obj, type):
        return replace(obj, **{f.name: map_leaves(getattr(obj, f.name), is_leaf, fn) for f in fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: map_leaves(v, is_leaf, fn) for k, v in obj.items()}
    if is_container(obj):
        return type(obj)(map_leaves(x, is_leaf, fn) for x in obj)
    return obj


def strip_tensors(obj: Any, tensors: list[Tensor]) -> Any:
    """obj with each tensor replaced by its TensorSpec; the tensors are appended to `tensors` in order."""

    def spec(t: Tensor) -> TensorSpec:
        tensors.append(t)
        return TensorSpec(t.dtype, tuple(t.shape))

    return map_leaves(obj, lambda x: isinstance(x, Tensor), spec)


def collect_specs(obj: Any, specs: list[TensorSpec]) -> None:
    map_leaves(obj, lambda x: isinstance(x, TensorSpec), specs.append)


def fill_tensors(obj: Any, tensors: Iterator[Tensor]) -> Any:
    return map_leaves(obj, lambda x: isinstance(x, TensorSpec), lambda _: next(tensors))
