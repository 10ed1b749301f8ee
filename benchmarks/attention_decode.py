"""Decode attention against the read bandwidth: the CPU kernel over a whole step's K/V (every layer), at 1 and 2
threads, beside a plain read of the same number of bytes (#29).

    python -m benchmarks.attention_decode [--threads 1,2] [--cases 5x300,20x300,64x300,128x300] [--rounds 5]
        [--source LABEL=FILE ...] [--layouts shuffled,shuffled+huge,sequential,shuffled+huge+f16]

The cache is laid out as the executor's KVCache (one tensor [layers, 2, blocks, block, kv_heads, head_dim], an
anonymous map as runner/kv_cache.py makes it), for the 32M benchmark model's heads (8 query / 4 KV / 64, 8 layers,
block 16); each sequence's blocks are shuffled across the cache (`shuffled`, a long-running server's free list) or
consecutive (`sequential`), in 4 KB pages or (`+huge`) 2 MB transparent huge pages (madvise), in float32 or (`+f16`)
float16 (--kv-cache-dtype float16: half the bytes, widened as they are read); each layout named in
--layouts gets its own cache, all timed in the same rounds. One step = the op called once per layer, as the model
does. Figures: best wall-clock ms of a step per implementation@layout and thread count (all interleaved round by
round), the K/V bytes it reads over that time (GB/s), and `read`: torch's sum over a contiguous tensor of the same
bytes (the box's read bandwidth in the same rounds). Each --source LABEL=FILE (another paged_attention_cpu.cpp, e.g.
`git show REV:executor_service/attention/csrc/paged_attention_cpu.cpp > /tmp/old.cpp`) is built under the op
namespace pagedserve_cpu_LABEL and timed beside the kernel.
"""

from __future__ import annotations

import argparse
import functools
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from executor_service.attention import cpu
from executor_service.kernels import build as cpu_build
from executor_service.runner.kv_cache import lazy_zeros

LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 8, 16, 8, 4, 64
Op = Callable[..., None]


@dataclass(slots=True)
class Step:
    """One decode step's attention inputs: `batch` sequences of `context` keys each, one query token each."""

    query: Tensor
    out: Tensor
    layers: list[tuple[Tensor, Tensor]]
    tables: Tensor
    lens: Tensor
    starts: Tensor
    seqs: Tensor
    kv_bytes: int
    control: Tensor  # a contiguous tensor of kv_bytes


def cache_map(dims: tuple[int, ...], hugepages: bool, dtype: torch.dtype) -> Tensor:
    """An anonymous private map as runner/kv_cache.py's lazy_zeros makes it, optionally in huge pages."""
    if not hugepages:
        return lazy_zeros(dims, dtype)
    buffer = mmap.mmap(-1, math.prod(dims) * dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype).view(dims)


def make_step(batch: int, context: int, layout: str, gen: torch.Generator) -> Step:
    """A step over a cache laid out as `layout` says (shuffled|sequential[+huge][+f16])."""
    order, *options = layout.split("+")
    dtype = torch.float16 if "f16" in options else torch.float32
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 16
    cache = cache_map((LAYERS, 2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), "huge" in options, dtype)
    cache.copy_(torch.randn(cache.shape, generator=gen))
    ids = torch.randperm(num_blocks, generator=gen) if order == "shuffled" else torch.arange(num_blocks)
    tables = ids[: batch * per_seq].reshape(batch, per_seq).to(torch.int32).contiguous()
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    return Step(query, torch.empty_like(query), [(cache[i, 0], cache[i, 1]) for i in range(LAYERS)], tables,
                torch.full((batch,), context, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32),
                torch.arange(batch, dtype=torch.int32), kv_bytes, torch.ones(kv_bytes // 4))


def load_source(label: str, source: Path) -> Op:
    """Build `source` with its ops renamed to pagedserve_cpu_<label> (cached beside the kernel's own builds)."""
    if not label.isidentifier():
        raise SystemExit(f"--source label {label!r} must be an identifier")
    text = source.read_text().replace("pagedserve_cpu,", f"pagedserve_cpu_{label},")
    directory = cpu_build.kernel_dir() / "bench-sources"
    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / f"paged_attention_{label}.cpp"
    copy.write_text(text)
    cpu_build.build_extension(f"pagedserve_cpu_attention_{label}", [copy])
    return getattr(torch.ops, f"pagedserve_cpu_{label}").paged_attention


def warm_threads() -> None:
    """Wake the thread team at the new thread count outside the timed calls."""
    torch.ones(1 << 16).sum()
    torch.ones(1 << 16).sum()


def run_step(op: Op, step: Step) -> None:
    for k, v in step.layers:
        op(step.out, step.query, k, v, step.tables, step.lens, step.starts, step.seqs, HEAD_DIM**-0.5)


def read_step(step: Step) -> None:
    step.control.sum()


def time_case(impls: dict[str, Op], steps: dict[str, Step], threads: list[int],
              rounds: int) -> dict[tuple[str, int], float]:
    """Best wall-clock seconds per (impl@layout, threads); `read` is the control. The first round warms up."""
    runs: dict[str, Callable[[], None]] = {}
    for layout, step in steps.items():
        for name, op in impls.items():
            runs[f"{name}@{layout}"] = functools.partial(run_step, op, step)
    runs["read"] = functools.partial(read_step, next(iter(steps.values())))
    best = {(name, n): float("inf") for name in runs for n in threads}
    for round_ in range(rounds + 1):
        for n in threads:
            torch.set_num_threads(n)
            warm_threads()
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
                if round_:
                    best[name, n] = min(best[name, n], seconds)
    return best


def check_same(impls: dict[str, Op], step: Step) -> None:
    """Every implementation gives the kernel's output on the last layer (within float32 reassociation)."""
    results = {}
    for name, op in impls.items():
        run_step(op, step)
        results[name] = step.out.clone()
    for name, out in results.items():
        torch.testing.assert_close(out, results["kernel"], rtol=1e-5, atol=1e-5, msg=f"{name} differs from kernel")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--cases", default="5x300,20x300,64x300,128x300", help="batch x context, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layouts", default="shuffled", help="comma-separated cache layouts timed side by side: "
                   "shuffled or sequential blocks, +huge for transparent huge pages (e.g. shuffled,shuffled+huge)")
    p.add_argument("--source", action="append", default=[], metavar="LABEL=FILE",
                   help="another paged_attention_cpu.cpp to time beside the kernel (repeatable; with a +f16 "
                   "layout, one that reads float16 caches)")
    args = p.parse_args()
    if not cpu.load():
        raise SystemExit("the CPU attention kernel did not build")
    impls: dict[str, Op] = {"kernel": torch.ops.pagedserve_cpu.paged_attention}
    for spec in args.source:
        label, _, path = spec.partition("=")
        impls[label] = load_source(label, Path(path))
    layouts = args.layouts.split(",")
    for layout in layouts:
        order, *options = layout.split("+")
        if order not in ("shuffled", "sequential") or not set(options) <= {"huge", "f16"}:
            raise SystemExit(f"--layouts: unknown layout {layout!r}")
    threads = [int(t) for t in args.threads.split(",")]
    names = [f"{name}@{layout}" for layout in layouts for name in impls] + ["read"]
    print(f"decode attention, {LAYERS} layers, heads {HEADS}/{KV_HEADS}/{HEAD_DIM}, block {BLOCK}; best of "
          f"{args.rounds} rounds, ms per step (GB/s of K/V)")
    print(f"{'case':10s} {'thr':>3s} " + " ".join(f"{n:>24s}" for n in names))
    gen = torch.Generator().manual_seed(0)
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        steps = {layout: make_step(batch, context, layout, gen) for layout in layouts}
        for step in steps.values():
            check_same(impls, step)
        best = time_case(impls, steps, threads, args.rounds)
        read_bytes = {name: steps[name.partition("@")[2]].kv_bytes for name in names if name != "read"}
        read_bytes["read"] = next(iter(steps.values())).control.nbytes
        for n in threads:
            cells = [f"{best[name, n] * 1e3:8.2f} ({read_bytes[name] / best[name, n] / 1e9:5.1f})" for name in names]
            print(f"{case:10s} {n:3d} " + " ".join(f"{c:>24s}" for c in cells))


if __name__ == "__main__":
    main()
