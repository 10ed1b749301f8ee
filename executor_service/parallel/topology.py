"""Where a tensor-parallel process stands: its rank, the world size and the nodes, from torchrun's
environment (RANK/WORLD_SIZE/LOCAL_RANK) or from the flags (`--tensor-parallel-size`, `--nnodes`,
`--node-rank`, `--master-addr`, `--master-port`). Torch-free: resolved before the ranks are spawned, so that
they import torch while rank 0 does (the device each rank runs on is `rank.pick_device`'s)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass

from executor_service.config import ExecutorConfig

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
DEFAULT_MASTER_PORT = 29500


class LaunchError(RuntimeError):
    """The tensor-parallel flags or environment cannot start an executor."""


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


def loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), names[0] if names else "lo")

