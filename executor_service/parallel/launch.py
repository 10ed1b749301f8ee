"""Tensor parallelism across processes: starting the ranks, the process group, and the step channel.

One process per device. `--tensor-parallel-size N` spawns this node's ranks with multiprocessing's spawn
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

Here: starting this node's ranks, without torch: the followers are spawned before this process imports it,
so that every rank imports it at the same time (one import's wait, not two in a row). The model's split is
checked once rank 0 has torch (stopping the spawned ranks when it cannot be split). Where a rank stands:
`topology`; one rank once torch is imported (the split check, the device, the process groups): `rank`;
fail-stop and the heartbeat: `supervision`; the step message: `channel`; rank 0's backend and the
followers: `backend`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.process import BaseProcess

from executor_service.backend import Backend
from executor_service.config import ExecutorConfig
from executor_service.default_model.paths import ensure_default_model
from executor_service.parallel.supervision import Guard
from executor_service.parallel.topology import LaunchError, Topology, loopback_interface, resolve_topology

log = logging.getLogger("pagedserve.executor")


def launch(config: ExecutorConfig, serve: Callable[[Backend], None]) -> int:
    """Start this node's ranks; local rank 0 of node 0 calls serve(backend) with the tensor-parallel
    backend until it returns (SIGTERM), then stops every rank. Start-up errors raise LaunchError or
    ModelLoadError (after stopping the ranks already spawned)."""
    topo = resolve_topology(config, os.environ)
    config = replace(config, model=config.model or str(ensure_default_model()))
    if topo.nnodes == 1:  # every rank on this host: keep gloo's traffic on the loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    guard = Guard()
    if topo.torchrun_rank is None:
        guard.children = spawn_ranks(config, topo)  # before torch is imported here: the imports overlap
    else:
        guard.watch_parent(os.getppid())
    local_rank = topo.torchrun_local_rank if topo.torchrun_rank is not None else 0
    try:
        from executor_service.parallel.rank import check_model, run_rank
        check_model(config, topo.world_size)
        guard.watch_children()
        run_rank(config, topo, local_rank, serve, guard)
    except BaseException:
        guard.stop_children(graceful=False)
        raise
    guard.stop_children(graceful=True)
    return 0


def spawn_ranks(config: ExecutorConfig, topo: Topology) -> list[BaseProcess]:
    """Ranks 1.. of this node, each in a fresh interpreter that imports torch itself (rank_main)."""
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
    from executor_service.model import ModelLoadError
    from executor_service.parallel.rank import run_rank
    try:
        run_rank(config, topo, local_rank, None, guard)
    except (ModelLoadError, LaunchError) as e:
        log.error("%s", e)
        sys.exit(2)
