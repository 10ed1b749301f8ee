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

Here: starting this node's ranks and the process groups. Where a rank stands: `topology`; fail-stop and
the heartbeat: `supervision`; the step message: `channel`; rank 0's backend and the followers: `backend`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from multiprocessing.process import BaseProcess
from pathlib import Path

import torch
import torch.distributed as dist

from executor_service.backend import Backend
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import ensure_default_model
from executor_service.model import ModelConfig, ModelLoadError, ParallelContext, ShardLayout
from executor_service.parallel.backend import TensorParallelBackend, follow
from executor_service.parallel.channel import StepChannel
from executor_service.parallel.supervision import Guard, heartbeat_interval
from executor_service.parallel.topology import LaunchError, Topology, loopback_interface, pick_device, resolve_topology
from executor_service.runner.torch_backend import TorchBackend

log = logging.getLogger("pagedserve.executor")
STARTUP_TIMEOUT_S = 600.0


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
