"""Megatron-style tensor parallelism inside the model: which slice of each weight one rank holds
(ShardLayout), the rank's process group (ParallelContext), and the layers that communicate.

Column-parallel layers (the fused QKV and gate/up projections) need no layer of their own: each rank
holds whole heads / an intermediate slice as a plain Linear. Row-parallel layers (o_proj, down_proj)
all-reduce their partial sums. The embedding and the LM head are split by vocabulary rows, padded to a
multiple of the world size; logits are all-gathered so every rank sees the same full row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.functional import embedding

from executor_service.model.config import ModelConfig, ModelLoadError
from executor_service.model.packed import Gemm, PackedWeight, can_pack, dense, pack, with_skinny_rows


@dataclass(slots=True, frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group; group None means one rank (no communication).
    setup_group (default: group) carries start-up agreements, which may wait for slower ranks to load."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    setup_group: dist.ProcessGroup | None = None

    def all_reduce(self, x: Tensor) -> Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: Tensor) -> Tensor:
        """Concatenate every rank's x along the last dimension, in rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def wait_for_all(self) -> None:
        """Start-up: return when every rank got here (over setup_group: loading may take long)."""
        if self.world_size > 1:
            dist.barrier(group=self.setup_group or self.group)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's value (e.g. KV blocks that fit on every device)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.setup_group or self.group)
        return int(t.item())


SINGLE = ParallelContext()


@dataclass(slots=True, frozen=True)
class ShardLayout:
    """The part of a model one rank holds. KV heads are split like the query heads; when there are fewer
    KV heads than ranks, each rank holds the one KV head its query heads use (replicated, as vLLM does)."""

    rank: int
    world_size: int
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_size: int
    vocab_per_rank: int

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, world_size: int = 1) -> ShardLayout:
        check_divisible(cfg, world_size)
        kv_heads = max(1, cfg.num_kv_heads // world_size)
        kv_start = rank * kv_heads if cfg.num_kv_heads >= world_size else rank * cfg.num_kv_heads // world_size
        return cls(
            rank=rank,
            world_size=world_size,
            head_dim=cfg.head_dim,
            num_heads=cfg.num_heads // world_size,
            num_kv_heads=kv_heads,
            kv_head_start=kv_start,
            intermediate_size=cfg.intermediate_size // world_size,
            vocab_size=cfg.vocab_size,
            vocab_per_rank=-(-cfg.vocab_size // world_size),
        )

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Real (unpadded) vocabulary rows on this rank."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))


def check_divisible(cfg: ModelConfig, world_size: int) -> None:
    if world_size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be at least 1, got {world_size}")
    problems = []
    if cfg.num_heads % world_size:
        problems.append(f"num_attention_heads ({cfg.num_heads})")
    if cfg.intermediate_size % world_size:
        problems.append(f"intermediate_size ({cfg.intermediate_size})")
    moe = cfg.features.moe
    if moe is not None and moe.intermediate_size % world_size:
        problems.append(f"the experts' intermediate size ({moe.intermediate_size})")
    if moe is not None and moe.shared_intermediate_size % world_size:
        problems.append(f"shared_expert_intermediate_size ({moe.shared_intermediate_size})")
    if cfg.num_kv_heads % world_size and world_size % cfg.num_kv_heads:
        problems.append(f"num_key_value_heads ({cfg.num_kv_heads}; or the size a multiple of it)")
    if problems:
        raise ModelLoadError(f"tensor_parallel_size {world_size} must divide {', '.join(problems)}")


class Linear(nn.Module):
    """y = x @ weight^T + bias on this rank's weight; after pack_weight(), on the CPU in float32, over the weight
    packed once for the CPU's GEMM (model/packed.py)."""

    packed: PackedWeight | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.packed = None

    def pack_weight(self, gemm: Gemm) -> None:
        self.packed = pack(self.weight.detach(), gemm) if can_pack(self.weight) else None

    def allow_skinny(self, packed: PackedWeight, rows: int) -> None:
        self.packed = with_skinny_rows(packed, self.weight.detach(), rows)

    def forward(self, x: Tensor) -> Tensor:
        return dense(x, self.weight, self.bias, self.packed)


class RowParallelLinear(Linear):
    """y = x_shard @ W_shard^T summed over ranks, then the bias once. One rank: a plain fused linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.parallel = parallel

    def forward(self, x: Tensor) -> Tensor:
        if self.parallel.world_size == 1:
            return super().forward(x)
        y = self.parallel.all_reduce(dense(x, self.weight, None, self.packed))
        return y if self.bias is None else y + self.bias


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a dimension split across ranks (OLMo 2's q/k norm spans all heads): each rank holds its slice of
    the rows and of the weight, and the sum of squares is all-reduced; `replicas` ranks hold each slice (KV heads
    replicated when there are fewer than ranks), so the sum counts it that many times."""

    def __init__(self, local_size: int, full_size: int, eps: float, dtype: torch.dtype, parallel: ParallelContext,
                 replicas: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_size, dtype=dtype))
        self.full_size, self.eps, self.parallel, self.replicas = full_size, eps, parallel, replicas

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        squares = self.parallel.all_reduce(x32.pow(2).sum(-1, keepdim=True)) / self.replicas
        return (self.weight * (x32 * torch.rsqrt(squares / self.full_size + self.eps))).to(x.dtype)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + vocab_per_rank) of the table; a token held elsewhere looks up
    zeros here, and the all-reduce leaves exactly its row."""

    def __init__(self, layout: ShardLayout, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.start = layout.vocab_start
        self.rows = layout.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(layout.vocab_per_rank, hidden_size, dtype=dtype))

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.parallel.world_size == 1:
            return embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = embedding(local.masked_fill(outside, 0), self.weight)
        return self.parallel.all_reduce(x.masked_fill_(outside[:, None], 0))


class ParallelLMHead(Linear):
    """The LM head split by vocabulary rows like the embedding; logits of all ranks gathered, padding cut."""

    def __init__(self, layout: ShardLayout, hidden_size: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__(hidden_size, layout.vocab_per_rank, False, dtype)
        self.parallel = parallel
        self.vocab_size = layout.vocab_size

    def forward(self, hidden: Tensor) -> Tensor:
        logits = super().forward(hidden)
        if self.parallel.world_size == 1:
            return logits
        return self.parallel.all_gather_last(logits)[:, : self.vocab_size]
