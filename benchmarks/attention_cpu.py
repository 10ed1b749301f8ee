"""Per-call time of a paged attention implementation on CPU, with the default model's attention shapes.

    python benchmarks/attention_cpu.py [--impl cpu | module:function]
                                       [--batch 64] [--context 200] [--spread 40] [--threads 1] [--rounds 20]

Cases (one layer's call): a pure decode step of --batch sequences whose context lengths are drawn
uniformly from context +- spread; the same step with 4 of them replaced by 64-token prefill chunks; one
512-token prompt prefill. Each figure is the best of --rounds timings (of 5 calls each).
"""

from __future__ import annotations

import argparse
import importlib
import random
import time
from collections.abc import Callable

import torch
from torch import Tensor

from executor_service.default_model import DEFAULT_SPEC

BLOCK_SIZE = 16
Args = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]


def make_call(seqs: list[tuple[int, int]], gen: torch.Generator) -> Args:
    """seqs: (cached context, query tokens) per sequence; blocks are shuffled across the cache."""
    spec = DEFAULT_SPEC
    lens = [ctx + q for ctx, q in seqs]
    needed = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(needed) + 8
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seqs), max(needed), dtype=torch.int32)
    for s, count in enumerate(needed):
        table[s, :count] = torch.tensor(ids[:count])
        del ids[:count]
    shape = (num_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    q_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), spec.num_heads, spec.head_dim, generator=gen)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return query, k_cache, v_cache, table, seq_lens, query_start_loc, spec.head_dim**-0.5


def best_ms(fn: Callable[..., Tensor], args: Args, rounds: int, inner: int = 5) -> float:
    for _ in range(3):
        fn(*args)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(inner):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / inner)
    return best * 1e3


def load_impl(spec: str) -> Callable[..., Tensor]:
    """"cpu" is what the executor gets on the CPU (get_attention_ops); "module:function" any other."""
    if spec == "cpu":
        from executor_service.attention import get_attention_ops

        return get_attention_ops("cpu")[1]
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impl", default="cpu", help='"cpu" (the executor\'s CPU attention) or module:function')
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--spread", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    fn = load_impl(args.impl)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    contexts = [rng.randint(args.context - args.spread, args.context + args.spread) for _ in range(args.batch)]
    decode = [(ctx, 1) for ctx in contexts]
    mixed = decode[:-4] + [(ctx, 64) for ctx in contexts[-4:]]
    cases = {"decode": decode, "decode+4 prefill chunks": mixed, "prefill 512": [(0, 512)]}
    print(f"impl={args.impl} batch={args.batch} context={args.context}+-{args.spread} threads={args.threads}")
    print(f"heads={DEFAULT_SPEC.num_heads} kv_heads={DEFAULT_SPEC.num_kv_heads} head_dim={DEFAULT_SPEC.head_dim}")
    for name, seqs in cases.items():
        print(f"  {name:26s} {best_ms(fn, make_call(seqs, gen), args.rounds):8.3f} ms/call")


if __name__ == "__main__":
    main()
