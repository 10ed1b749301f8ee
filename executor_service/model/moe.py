"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a softmax router picks top_k experts per token
(their weights renormalised where the family does), tokens are grouped by expert and each expert runs one GEMM
pair over its tokens; an optional shared expert, scaled by a sigmoid gate, is added. Under tensor parallelism
each rank holds a slice of every expert's intermediate dimension (as the dense MLP), so the sum is all-reduced."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.functional import linear, silu

from executor_service.model.families import MoEConfig
from executor_service.model.parallel import Linear, ParallelContext


class ExpertWeights(nn.Module):
    """Every expert's gate and up projections stacked [E, 2 * inter, hidden] and down [E, hidden, inter]."""

    def __init__(self, num_experts: int, hidden_size: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=dtype))
        self.intermediate_size = inter

    def run(self, expert: int, x: Tensor) -> Tensor:
        gate, up = linear(x, self.w13[expert]).split(self.intermediate_size, dim=-1)
        return linear(silu(gate).mul_(up), self.w2[expert])


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, inter: int, shared: nn.Module | None, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.num_experts = moe.num_experts
        self.parallel = parallel
        self.gate = Linear(hidden_size, moe.num_experts, False, dtype)
        self.experts = ExpertWeights(moe.num_experts, hidden_size, inter, dtype)
        self.shared_expert = shared
        self.shared_expert_gate = Linear(hidden_size, 1, False, dtype) if shared is not None else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top_k experts [T, k] and their float32 weights [T, k]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: Tensor) -> Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, token_weights = order // self.top_k, weights.flatten().index_select(0, order)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                y = self.experts.run(expert, x.index_select(0, rows)) * token_weights[start : start + count, None]
                out.index_add_(0, rows, y.to(x.dtype))
                start += count
        out = self.parallel.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
