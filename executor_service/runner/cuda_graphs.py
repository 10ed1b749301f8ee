"""CUDA graphs of the decode forward pass (one new token per sequence), one per bucketed batch size.

A decode step of n sequences replays the graph of the smallest captured size >= n: its inputs are copied into
static buffers, the padding rows get slot -1 (their K/V are not written) and a context of one token, and the
first n rows of the graph's output are used. Larger batches and steps with prefill run eagerly. Only the Triton
attention ops are capturable (the reference ops plan on the host). Opt-in with --cuda-graph-sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from executor_service.model import AttentionMetadata, LlamaForCausalLM
from executor_service.model.llama import KVCaches


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """The graphs' inputs, sized for the largest graph: a replay reads whatever these buffers hold."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor

    @classmethod
    def allocate(cls, largest: int, max_blocks: int, device: torch.device) -> StaticInputs:
        return cls(input_ids=torch.zeros(largest, dtype=torch.long, device=device),
                   positions=torch.zeros(largest, dtype=torch.long, device=device),
                   slot_mapping=torch.full((largest,), -1, dtype=torch.long, device=device),
                   block_tables=torch.zeros(largest, max_blocks, dtype=torch.int32, device=device),
                   seq_lens=torch.ones(largest, dtype=torch.int32, device=device),
                   query_start_loc=torch.arange(largest + 1, dtype=torch.int32, device=device))

    def meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 self.query_start_loc[: size + 1])


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCaches, sizes: tuple[int, ...], max_blocks: int,
                 device: torch.device) -> None:
        if device.type != "cuda" or not sizes:
            raise ValueError("decode graphs need a CUDA device and at least one batch size")
        self.sizes = sizes
        self.inputs = StaticInputs.allocate(sizes[-1], max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        self.capture(model, kv_caches)

    def capture(self, model: LlamaForCausalLM, kv_caches: KVCaches) -> None:
        pool = None
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
                args = (self.inputs.input_ids[:size], self.inputs.positions[:size], self.inputs.meta(size),
                        kv_caches)
                model(*args)  # warm-up outside the graph (kernel compilation, allocator)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = model(*args)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int) -> int | None:
        return next((s for s in self.sizes if s >= num_seqs), None)

    def run(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor | None:
        """Hidden states [n, hidden] of a decode step of n sequences, or None when no graph fits it."""
        n = input_ids.shape[0]
        size = self.bucket(n)
        width = meta.block_tables.shape[1]
        inputs = self.inputs
        if size is None or meta.seq_lens.shape[0] != n or width > inputs.block_tables.shape[1]:
            return None
        inputs.input_ids[:n].copy_(input_ids)
        inputs.positions[:n].copy_(positions)
        inputs.slot_mapping[:n].copy_(meta.slot_mapping)
        inputs.slot_mapping[n:size].fill_(-1)
        inputs.block_tables[:n, :width].copy_(meta.block_tables)
        inputs.seq_lens[:n].copy_(meta.seq_lens)
        inputs.seq_lens[n:size].fill_(1)
        self.graphs[size].replay()
        return self.outputs[size][:n]
