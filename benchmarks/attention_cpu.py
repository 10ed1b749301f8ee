"""The CPU paged-attention kernel side by side with its portable path, the torch reference and (optionally) an
older kernel source, per layer call, in thread CPU time.

    python -m benchmarks.attention_cpu [--old-source FILE] [--layers 4] [--rounds 5] [--threads 1]

Cases: decode steps of (batch, context) = (64, 48), (64, 200), (128, 100), (16, 300), (4, 400), (1, 1000) and one
16-token prefill chunk after 200 cached tokens (batch 1), for the default model's heads (4 query / 2 KV / 64) and
the 32M benchmark model's (8 / 4 / 64); block size 16, blocks shuffled across the cache. Each impl computes the
same call on --layers caches in turn (as the model's layers would: the K/V are not all in L2), implementations
interleaved round by round; each figure is the best round's mean per call. `kernel` is torch.ops.pagedserve_cpu.
paged_attention (the AVX-512 tile where built), `portable` its portable path, `reference` the torch reference,
`old` the --old-source file (an earlier paged_attention_cpu.cpp, e.g. `git show REV:path > /tmp/old.cpp`) built
under another op namespace.
"""

from __future__ import annotations

import argparse
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from executor_service.attention import cpu, reference
from executor_service.kernels import build as cpu_build

BLOCK_SIZE = 16
HEADS = {"default (4/2/64)": (4, 2, 64), "32M (8/4/64)": (8, 4, 64)}
DECODES = [(64, 48), (64, 200), (128, 100), (16, 300), (4, 400), (1, 1000)]
Call = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float]
Impl = Callable[[Call], None]


def make_call(seqs: list[tuple[int, int]], heads: tuple[int, int, int], gen: torch.Generator) -> Call:
    """seqs: (cached context, query tokens) per sequence. Returns the op's arguments (out first, seqs last)."""
    num_heads, num_kv_heads, head_dim = heads
    lens = [ctx + q for ctx, q in seqs]
    needed = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(needed) + 8
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seqs), max(needed), dtype=torch.int32)
    for s, count in enumerate(needed):
        table[s, :count] = torch.tensor(ids[:count])
        del ids[:count]
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    q_lens = torch.tensor([q for _, q in seqs])
    starts = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(q_lens, 0)
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen)
    return (torch.empty_like(query), query, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen),
            table, torch.tensor(lens, dtype=torch.int32), starts, torch.arange(len(seqs), dtype=torch.int32),
            head_dim**-0.5)


def op_impl(op: Callable[..., None]) -> Impl:
    return lambda call: op(*call)


def reference_impl() -> Impl:
    scratches: dict[int, reference.Scratch] = {}

    def run(call: Call) -> None:
        scratch = scratches.setdefault(id(call[1]), reference.Scratch())
        reference.paged_attention(*call[1:7], call[8], scratch)

    return run


def load_old(source: Path) -> Impl:
    """Build `source` with its ops renamed to pagedserve_cpu_old (cached beside the kernel's own builds)."""
    text = source.read_text().replace("pagedserve_cpu,", "pagedserve_cpu_old,")
    directory = cpu_build.kernel_dir() / "bench-old-sources"
    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / f"paged_attention_old-{hashlib.sha256(text.encode()).hexdigest()[:16]}.cpp"
    copy.write_text(text)
    cpu_build.build_extension("pagedserve_cpu_attention_old", [copy])
    return op_impl(torch.ops.pagedserve_cpu_old.paged_attention)


def time_impls(impls: dict[str, Impl], layers: list[Call], rounds: int) -> dict[str, float]:
    """Best round's thread CPU µs per call; one round = every impl once over all layers, impls interleaved."""
    best = dict.fromkeys(impls, float("inf"))
    inner = max(1, 200 // len(layers))
    for _ in range(rounds + 1):  # the first round warms up
        for name, impl in impls.items():
            start = time.thread_time()
            for _ in range(inner):
                for call in layers:
                    impl(call)
            best[name] = min(best[name], (time.thread_time() - start) / (inner * len(layers)) * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old-source", type=Path, help="an earlier paged_attention_cpu.cpp to time beside the kernel")
    p.add_argument("--layers", type=int, default=4, help="distinct caches per case, called in turn")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.load():
        raise SystemExit("the CPU attention kernel did not build")
    impls: dict[str, Impl] = {"kernel": op_impl(torch.ops.pagedserve_cpu.paged_attention),
                              "portable": op_impl(torch.ops.pagedserve_cpu.paged_attention_portable),
                              "reference": reference_impl()}
    if args.old_source is not None:
        impls["old"] = load_old(args.old_source)
    others = [name for name in impls if name != "kernel"]
    print(f"threads={args.threads} layers={args.layers} block={BLOCK_SIZE} "
          f"avx512={torch.ops.pagedserve_cpu.has_avx512()}; µs per layer call (thread CPU), ratio = other / kernel")
    print(f"{'heads':18s} {'case':18s} " + " ".join(f"{n:>10s}" for n in impls) + "  "
          + " ".join(f"{n + '/kernel':>16s}" for n in others))
    gen = torch.Generator().manual_seed(0)
    for label, heads in HEADS.items():
        cases = {f"decode {b} x {c}": [(c - 1, 1)] * b for b, c in DECODES}
        cases["prefill 16 @ 200"] = [(200, 16)]
        for case, seqs in cases.items():
            layers = [make_call(seqs, heads, gen) for _ in range(args.layers)]
            us = time_impls(impls, layers, args.rounds)
            print(f"{label:18s} {case:18s} " + " ".join(f"{us[n]:10.1f}" for n in impls) + "  "
                  + " ".join(f"{us[n] / us['kernel']:15.2f}x" for n in others))


if __name__ == "__main__":
    main()
