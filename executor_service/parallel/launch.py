"""Tensor parallelism across processes: starting the ranks, the process group, and the step channel.

One process per device. `--tensor-parallel-size N` spawns this node's ranks with torch.multiprocessing
(`--nnodes/--node-rank/--master-addr/--master-port` spread them over machines); under torchrun each
process is one rank and reads RANK/WORLD_SIZE/LOCAL_RANK. NCCL carries the model's collectives on CUDA,
gloo on the CPU; a gloo group carries the control messages.

Rank 0 serves the Executor API. Every backend call it makes (a forward pass, a swap, a copy) first goes
to the other ranks as one broadcast message (the op and its block pairs, or the batch with its tensors
packed into one buffer), and they run it in step; the row-parallel all-reduces and the logits all-gather
happen inside the forward pass. Idle, rank 0 broadcasts a heartbeat that every rank answers (a barrier),
so every collective wait is bounded by --distributed-timeout, and a peer that hangs is found while idle.
Failure is fail-stop: a rank that dies or fails a collective ends the whole
executor (every rank exits, rank 0 without answering the step in flight), and the scheduler sees a lost
executor and recomputes.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, is_dataclass, replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from executor_service.backend import Backend, BackendLost, BatchItem, BlockMap, SampleOutput
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import ensure_default_model
from executor_service.model import ModelConfig, ModelLoadError, ParallelContext, ShardLayout
from executor_service.runner.torch_backend import Batch, TorchBackend, resolve_device

log = logging.getLogger("pagedserve.executor")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_MASTER_PORT = 29500
MAX_HEARTBEAT_S = 5.0
STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 10.0
ALIGN = 16
HEADER_BYTES = 16  # two int64: pickled Message length, frame length
FRAME_BYTES = 1 << 16


class LaunchError(RuntimeError):
    """The tensor-parallel flags or environment cannot start an executor."""


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


@dataclass(slots=True, frozen=True)
class Topology:
    world_size: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    torchrun_rank: int | None = None
    torchrun_local_rank: int = 0

    @property
    def nproc_per_node(self) -> int:
        return self.world_size // self.nnodes

    def rank_of(self, local_rank: int) -> int:
        if self.torchrun_rank is not None:
            return self.torchrun_rank
        return self.node_rank * self.nproc_per_node + local_rank


def resolve_topology(config: ExecutorConfig, env: Mapping[str, str]) -> Topology:
    """Where this process stands: from torchrun's environment, else from the flags."""
    size, nnodes = config.tensor_parallel_size, config.nnodes
    if config.simulated:
        raise LaunchError("--tensor-parallel-size needs the torch executor, not --simulated")
    if not config.distributed_timeout > 0:
        raise LaunchError(f"--distributed-timeout must be positive, got {config.distributed_timeout}")
    if all(k in env for k in TORCHRUN_ENV):
        world = int(env["WORLD_SIZE"])
        if world != size:
            raise LaunchError(f"torchrun started WORLD_SIZE={world} processes but --tensor-parallel-size is {size}")
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return Topology(world, max(1, world // local_world), int(env.get("GROUP_RANK", "0")),
                        env.get("MASTER_ADDR", config.master_addr), int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)),
                        int(env["RANK"]), int(env["LOCAL_RANK"]))
    if size < 1 or nnodes < 1 or size % nnodes:
        raise LaunchError(f"--tensor-parallel-size ({size}) must be a positive multiple of --nnodes ({nnodes})")
    if not 0 <= config.node_rank < nnodes:
        raise LaunchError(f"--node-rank must be in [0, {nnodes}), got {config.node_rank}")
    port = config.master_port
    if port is None:
        port = free_port(config.master_addr) if nnodes == 1 else DEFAULT_MASTER_PORT
    return Topology(size, nnodes, config.node_rank, config.master_addr, port)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---- launching ---------------------------------------------------------------------------------------


def launch(config: ExecutorConfig, serve: Callable[[Backend], None]) -> int:
    """Start this node's ranks; local rank 0 of node 0 calls serve(backend) with the tensor-parallel
    backend until it returns (SIGTERM), then stops every rank. Start-up errors raise LaunchError or
    ModelLoadError."""
    topo = resolve_topology(config, os.environ)
    config = replace(config, model=config.model or str(ensure_default_model()))
    check_model(config, topo.world_size)
    if topo.nnodes == 1:  # every rank on this host: keep gloo's traffic on the loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    guard = Guard()
    if topo.torchrun_rank is None:
        guard.children = spawn_ranks(config, topo)
    else:
        guard.watch_parent(os.getppid())
    guard.watch_children()
    local_rank = topo.torchrun_local_rank if topo.torchrun_rank is not None else 0
    try:
        run_rank(config, topo, local_rank, serve, guard)
    except BaseException:
        guard.stop_children(graceful=False)
        raise
    guard.stop_children(graceful=True)
    return 0


def check_model(config: ExecutorConfig, world_size: int) -> None:
    """Fail before spawning anything when the model cannot be split this way."""
    directory = Path(config.model or "")
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    ShardLayout.of(ModelConfig.from_dir(directory), 0, world_size)


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0] if names else "lo")


def spawn_ranks(config: ExecutorConfig, topo: Topology) -> list[BaseProcess]:
    ctx = multiprocessing.get_context("spawn")
    children: list[BaseProcess] = []
    for local_rank in range(1, topo.nproc_per_node):
        child = ctx.Process(target=rank_main, args=(config, topo, local_rank, os.getpid()),
                            name=f"rank-{topo.rank_of(local_rank)}", daemon=True)
        child.start()
        log.info("tensor-parallel rank %d started as pid %d", topo.rank_of(local_rank), child.pid)
        children.append(child)
    return children


def rank_main(config: ExecutorConfig, topo: Topology, local_rank: int, parent_pid: int) -> None:
    """A spawned rank: SIGINT is left to the parent, which coordinates shutdown."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = topo.rank_of(local_rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s")
    guard = Guard()
    guard.watch_parent(parent_pid)
    try:
        run_rank(config, topo, local_rank, None, guard)
    except (ModelLoadError, LaunchError) as e:
        log.error("%s", e)
        sys.exit(2)


def run_rank(config: ExecutorConfig, topo: Topology, local_rank: int, serve: Callable[[Backend], None] | None,
             guard: Guard) -> None:
    """Join the group, load this rank's shard, then serve (rank 0) or follow rank 0 (the others)."""
    rank = topo.rank_of(local_rank)
    device = pick_device(config, local_rank, topo.nproc_per_node)
    parallel, control = init_group(topo, rank, device, config.distributed_timeout)
    backend = TorchBackend.create(config, parallel)
    parallel.wait_for_all()  # every rank is ready (start-up timeout) before the collective timeout applies
    channel = StepChannel(parallel, control, backend.device)
    if rank == 0:
        if serve is None:
            raise LaunchError("rank 0 must be the process that serves the Executor API")
        lead(backend, channel, topo, serve, guard, heartbeat_interval(config.distributed_timeout))
    else:
        log.info("rank %d of %d ready on %s: %d KV blocks", rank, topo.world_size, backend.device,
                 backend.info.num_device_blocks)
        try:
            follow(backend, channel)
        except Exception as e:  # a collective failed or timed out: rank 0 or a peer is gone
            guard.fail(f"rank {rank}: {e}")
        guard.stopping = True
    dist.destroy_process_group()


def lead(backend: TorchBackend, channel: StepChannel, topo: Topology, serve: Callable[[Backend], None],
         guard: Guard, heartbeat_s: float) -> None:
    leader = TensorParallelBackend(backend, channel, guard.fail, heartbeat_s)
    log.info("tensor parallel: %d ranks on %d node(s), %s, %d KV heads per rank", topo.world_size, topo.nnodes,
             dist.get_backend(), backend.model.layout.num_kv_heads)
    try:
        serve(leader)
    finally:
        guard.stopping = True
        leader.close()


def heartbeat_interval(timeout: float) -> float:
    return max(0.05, min(MAX_HEARTBEAT_S, timeout / 4))


def pick_device(config: ExecutorConfig, local_rank: int, nproc: int) -> torch.device:
    device = resolve_device(config.device)
    if device.type == "cuda":
        if torch.cuda.device_count() < nproc:
            raise LaunchError(f"{nproc} ranks per node need {nproc} CUDA devices, found {torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if "OMP_NUM_THREADS" not in os.environ:  # the node's cores are shared by its ranks
        torch.set_num_threads(max(1, torch.get_num_threads() // nproc))
    return device


def init_group(topo: Topology, rank: int, device: torch.device,
               timeout_s: float) -> tuple[ParallelContext, dist.ProcessGroup]:
    """The model's group (NCCL on CUDA, gloo on CPU) and a gloo group for control messages, both with
    the collective timeout. The world group, with a start-up timeout, only gathers the ranks."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    init = "env://" if topo.torchrun_rank is not None else f"tcp://{topo.master_addr}:{topo.master_port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=topo.world_size,
                            timeout=timedelta(seconds=max(STARTUP_TIMEOUT_S, timeout_s)))
    timeout = timedelta(seconds=timeout_s)
    model = dist.new_group(backend=backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else model
    return ParallelContext(rank, topo.world_size, model, dist.group.WORLD), control


# ---- failure -----------------------------------------------------------------------------------------


class Guard:
    """Fail-stop for one process: a dead child rank, a dead parent or a failed collective ends it (after
    terminating its children) without answering anything more."""

    def __init__(self) -> None:
        self.children: list[BaseProcess] = []
        self.stopping = False
        self._failing = False
        self._lock = threading.Lock()
        self._never = threading.Event()

    def fail(self, reason: str) -> None:
        """End the process; returns only during a graceful stop. A failure found while another thread is
        already ending the process (a dead rank seen by the watcher and by the collective in flight) waits
        for that exit, so its caller never answers the step in flight."""
        with self._lock:
            if self.stopping and not self._failing:
                return
            first = not self._failing
            self._failing = self.stopping = True
        if not first:
            self._never.wait()
        log.error("tensor-parallel executor going down: %s", reason)
        self.stop_children(graceful=False)
        logging.shutdown()
        os._exit(1)

    def watch_children(self) -> None:
        if self.children:
            threading.Thread(target=self._wait_children, name="rank-watch", daemon=True).start()

    def _wait_children(self) -> None:
        sentinels = {child.sentinel: child for child in self.children}
        ready = multiprocessing.connection.wait(list(sentinels))
        child = sentinels[ready[0]]  # type: ignore[index]
        child.join(1.0)
        if not self.stopping:
            self.fail(f"{child.name} (pid {child.pid}) exited with code {child.exitcode}")

    def watch_parent(self, parent_pid: int) -> None:
        threading.Thread(target=self._wait_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()

    def _wait_parent(self, parent_pid: int) -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        self.fail(f"parent process {parent_pid} is gone")

    def stop_children(self, graceful: bool) -> None:
        deadline = time.monotonic() + (STOP_GRACE_S if graceful else 0.0)
        for child in self.children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.terminate()
        for child in self.children:
            child.join(2.0)
            if child.is_alive():
                child.kill()
                child.join()


# ---- the step channel ----------------------------------------------------------------------------------


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


# ---- the ranks ---------------------------------------------------------------------------------------------


def follow(backend: TorchBackend, channel: StepChannel) -> None:
    """A rank other than 0: run what rank 0 broadcasts, in order, until it says stop."""
    while True:
        message = channel.receive()
        match message.op:
            case Op.EXECUTE:
                backend.run_batch(message.batch)
            case Op.SWAP_OUT:
                backend.swap_out(message.mapping)
            case Op.SWAP_IN:
                backend.swap_in(message.mapping)
            case Op.COPY:
                backend.copy(message.mapping)
            case Op.HEARTBEAT:
                channel.answer_heartbeat()
            case Op.STOP:
                return


class TensorParallelBackend:
    """Rank 0's Backend: each call is checked here, broadcast, then run here and on every rank in step.
    A failed broadcast or collective calls on_failure (fail-stop), so no half-run step is ever answered; if
    on_failure returns (the executor is stopping anyway), the call raises BackendLost, which ends the stream."""

    def __init__(self, local: TorchBackend, channel: StepChannel, on_failure: Callable[[str], None],
                 heartbeat_s: float) -> None:
        self.info = local.info
        self.local = local
        self.channel = channel
        self.on_failure = on_failure
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._beat, args=(heartbeat_s,), name="tp-heartbeat", daemon=True)
        self._heartbeat.start()
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def execute_async(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        return await asyncio.get_running_loop().run_in_executor(self._forward_thread, self.execute, items)

    def swap_out(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.SWAP_OUT, mapping, self.local.swap_out)

    def swap_in(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.SWAP_IN, mapping, self.local.swap_in)

    def copy(self, mapping: BlockMap) -> None:
        self._run_blocks(Op.COPY, mapping, self.local.copy)

    def execute(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        if not items:
            return []
        with self._lock:
            batch = self.local.prepare(items)  # bad input raises here, before anything is sent
            try:
                self._send(Op.EXECUTE, batch=batch)
                logits = self.local.run_batch(batch)
            except Exception as e:
                self.on_failure(f"forward pass: {e}")
                raise BackendLost(f"forward pass: {e}") from e
        return self.local.sample(items, batch, logits)

    def close(self) -> None:
        """Tell every rank to exit (the executor is shutting down)."""
        self._closed.set()
        with self._lock:
            try:
                self._send(Op.STOP)
            except Exception as e:
                log.warning("could not tell the ranks to stop: %s", e)

    def _run_blocks(self, op: Op, mapping: BlockMap, run: Callable[[BlockMap], None]) -> None:
        if not mapping:
            return
        with self._lock:
            run(mapping)  # checks the block ids; a bad mapping raises before anything is sent
            try:
                self._send(op, mapping)
            except Exception as e:
                self.on_failure(f"{op.name.lower()}: {e}")
                raise BackendLost(f"{op.name.lower()}: {e}") from e

    def _send(self, op: Op, mapping: BlockMap | None = None, batch: Batch | None = None) -> None:
        self.channel.send(op, mapping, batch)
        self._last_send = time.monotonic()

    def _beat(self, interval: float) -> None:
        while not self._closed.wait(interval):
            with self._lock:
                if self._closed.is_set() or time.monotonic() - self._last_send < interval:
                    continue
                try:
                    self._send(Op.HEARTBEAT)
                    self.channel.answer_heartbeat()
                except Exception as e:
                    self.on_failure(f"heartbeat: {e}")
                    return
