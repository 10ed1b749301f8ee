"""One tensor-parallel rank once torch is imported: check the split, pick the device, join the process groups,
load this rank's shard, then serve (rank 0) or follow rank 0 (the others). Starting the ranks, before torch is
imported, is `launch`'s."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from executor_service.backend import Backend
from executor_service.config import ExecutorConfig
from executor_service.model import ModelConfig, ModelLoadError, ParallelContext, ShardLayout
from executor_service.parallel.backend import TensorParallelBackend, follow
from executor_service.parallel.channel import StepChannel
from executor_service.parallel.supervision import Guard, heartbeat_interval
from executor_service.parallel.topology import LaunchError, Topology
from executor_service.runner.torch_backend import TorchBackend, resolve_device

log = logging.getLogger("pagedserve.executor")
STARTUP_TIMEOUT_S = 600.0


def check_model(config: ExecutorConfig, world_size: int) -> None:
    """Fail early, with one clear line, when the model cannot be split this way."""
    directory = Path(config.model or "")
    if not directory.is_dir():
        raise ModelLoadError(f"model directory {directory} does not exist")
    ShardLayout.of(ModelConfig.from_dir(directory), 0, world_size)


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
