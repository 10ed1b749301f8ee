"""Mixture-of-experts MLPs. SparseMoE (Mixtral, Qwen2-MoE, Qwen3-MoE): a softmax router picks top_k experts per
token (their weights renormalised where the family does), tokens are grouped by expert and each expert runs one
GEMM pair over its tokens (on the CPU in float32, once pack_experts() has packed the experts: all of them in one
C++ call, cpu_ops.moe_experts); an optional shared expert, scaled by a sigmoid gate, is added. Under tensor parallelism
each rank holds a slice of every expert's intermediate dimension (as the dense MLP), so the sum is all-reduced.
OaiMoE (GPT-OSS): a biased router, softmax over the top_k logits, biased experts stored as in the checkpoint
(x @ W, gate and up interleaved) with a clamped SwiGLU."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.functional import silu

from executor_service.model import cpu_ops
from executor_service.model.families import MoEConfig
from executor_service.model.parallel import Linear, ParallelContext


class Expert(nn.Module):
    """One expert: its gate and up projections fused (gate_up_proj) and down_proj, plain linears (packed for the
    CPU's GEMM like the model's others); under tensor parallelism this rank's intermediate rows, summed by the
    caller."""

    def __init__(self, hidden_size: int, inter: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = inter
        self.gate_up_proj = Linear(hidden_size, 2 * inter, False, dtype)
        self.down_proj = Linear(inter, hidden_size, False, dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(silu(gate).mul_(up))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, inter: int, shared: nn.Module | None, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.num_experts = moe.num_experts
        self.intermediate_size = inter
        self.parallel = parallel
        self.gate = Linear(hidden_size, moe.num_experts, False, dtype)
        self.experts = nn.ModuleList(Expert(hidden_size, inter, dtype) for _ in range(moe.num_experts))
        self.shared_expert = shared
        self.shared_expert_gate = Linear(hidden_size, 1, False, dtype) if shared is not None else None
        self.packed: tuple[Tensor, Tensor] | None = None

    def can_fuse(self) -> bool:
        """Whether pack_experts() can pack these experts for cpu_ops.moe_experts: float32 CPU weights, the
        intermediate size a multiple of 16 and the hidden size of 32, and the kernel built here."""
        weight = self.gate.weight
        return (weight.device.type == "cpu" and weight.dtype == torch.float32 and self.intermediate_size % 16 == 0
                and weight.shape[1] % 32 == 0 and cpu_ops.moe_available())

    def pack_experts(self) -> None:
        """Pack every expert's weights into moe_experts' panels (csrc/moe_cpu.cpp), from now on used by forward."""
        if not self.can_fuse():
            return
        experts = [e for e in self.experts if isinstance(e, Expert)]
        w13 = torch.stack([e.gate_up_proj.weight.detach() for e in experts])  # [E, 2I, H]
        w2 = torch.stack([e.down_proj.weight.detach() for e in experts])  # [E, H, I]
        self.packed = (pack_gate_up(w13, self.intermediate_size), pack_down(w2))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top_k experts [T, k] and their float32 weights [T, k]."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: Tensor) -> Tensor:
        experts, weights = self.route(x)
        if self.packed is not None and x.is_contiguous():
            out = cpu_ops.moe_experts(x, experts, weights, *self.packed)
        else:
            out = self.run_experts(x, experts, weights)
        out = self.parallel.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


    def run_experts(self, x: Tensor, experts: Tensor, weights: Tensor) -> Tensor:
        """The torch path: tokens grouped by expert, one GEMM pair per expert, scattered back weighted."""
        out = torch.zeros_like(x)
        for expert, rows, row_weights in group_by_expert(experts, weights, self.num_experts):
            y = self.experts[expert](x.index_select(0, rows)) * row_weights[:, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return out


def pack_gate_up(w13: Tensor, inter: int) -> Tensor:
    """[E, 2I, H] (gate rows, then up rows) -> [E, I / 16, H, 32]: panel p's row k holds column k of gate rows
    16p..16p+15 then of the same up rows."""
    num_experts, _, hidden = w13.shape
    gate = w13[:, :inter].reshape(num_experts, inter // 16, 16, hidden)
    up = w13[:, inter:].reshape(num_experts, inter // 16, 16, hidden)
    return torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()


def pack_down(w2: Tensor) -> Tensor:
    """[E, H, I] -> [E, H / 32, I, 32]: panel q's row k holds column k of down rows 32q..32q+31."""
    num_experts, hidden, inter = w2.shape
    return w2.reshape(num_experts, hidden // 32, 32, inter).transpose(2, 3).contiguous()


def group_by_expert(experts: Tensor, weights: Tensor, num_experts: int) -> list[tuple[int, Tensor, Tensor]]:
    """(expert, its tokens' rows, their weights) for every expert some token chose, in expert order."""
    top_k = experts.shape[1]
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tokens, token_weights = order // top_k, weights.flatten().index_select(0, order)
    groups, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            groups.append((expert, tokens[start : start + count], token_weights[start : start + count]))
            start += count
    return groups


class OaiExperts(nn.Module):
    """GPT-OSS's experts as its checkpoint stores them: gate_up_proj [E, hidden, 2 * inter] (gate and up
    interleaved), down_proj [E, inter, hidden], and their biases; under tensor parallelism this rank's intermediate
    rows, and the down projection's bias added on rank 0 only (the caller sums the ranks)."""

    def __init__(self, num_experts: int, hidden_size: int, inter: int, dtype: torch.dtype,
                 swiglu: tuple[float, float], add_down_bias: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * inter, dtype=dtype))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden_size, dtype=dtype))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))
        self.alpha, self.limit = swiglu
        self.add_down_bias = add_down_bias

    def run(self, expert: int, x: Tensor) -> Tensor:
        gate_up = torch.addmm(self.gate_up_proj_bias[expert], x, self.gate_up_proj[expert])
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        if not self.add_down_bias:
            return torch.mm((up + 1) * glu, self.down_proj[expert])
        return torch.addmm(self.down_proj_bias[expert], (up + 1) * glu, self.down_proj[expert])


class OaiMoE(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, inter: int, dtype: torch.dtype,
                 parallel: ParallelContext) -> None:
        super().__init__()
        if moe.swiglu is None:
            raise ValueError("OaiMoE needs the experts' SwiGLU alpha and limit")
        self.top_k = moe.top_k
        self.num_experts = moe.num_experts
        self.parallel = parallel
        self.router = Linear(hidden_size, moe.num_experts, True, dtype)
        self.experts = OaiExperts(moe.num_experts, hidden_size, inter, dtype, moe.swiglu, parallel.rank == 0)

    def forward(self, x: Tensor) -> Tensor:
        values, experts = self.router(x).topk(self.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
        out = torch.zeros_like(x)
        for expert, rows, row_weights in group_by_expert(experts, weights, self.num_experts):
            y = self.experts.run(expert, x.index_select(0, rows)) * row_weights[:, None]
            out.index_add_(0, rows, y.to(x.dtype))
        return self.parallel.all_reduce(out)
