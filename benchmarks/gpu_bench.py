"""GPU limits and kernels, measured in one run on a CUDA machine (benchmarks/gpu_check.sh runs it).

    python -m benchmarks.gpu_bench [--model DIR] [--sizes 1,2,4,...] [--json-out FILE]

1. Device limits: fp16 matmul peak (8192^3, and the model's own linear shapes) and HBM bandwidth (read, copy).
2. Paged attention: the Triton kernel against torch SDPA on the same shapes with contiguous K/V (the unpaged
   ideal) and against the reference (gather + SDPA); decode and prefill; K/V bytes read per second as a % of HBM.
3. Swap: KVCache.swap_out / swap_in of many blocks in GB/s, beside a plain pinned host<->device copy of the
   same bytes (the PCIe / NVLink limit as this machine sees it).
4. CUDA graphs: decode steps through TorchBackend.execute with --cuda-graph-sizes against eager, per batch size;
   the sampled tokens must be equal.
Exits 1 when there is no CUDA device, or when graphs and eager disagree.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.roofline import ModelShape, limits_record, measure_limits

GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def cuda_time(fn: Callable[[], object], reps: int = 20) -> float:
    """Seconds per call (CUDA events, best of 3 rounds)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def device_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    return 2 * 8192**3 / cuda_time(lambda: a @ a, reps=10) / 1e12


def attention_cases(read_gbs: float) -> list[dict[str, Any]]:
    from executor_service.attention import reference, triton_paged

    rows = []
    heads, kv_heads, dim, block = 32, 8, 128, 16
    for num_seqs, ctx, q_len in [(64, 1024, 1), (256, 2048, 1), (8, 1024, 1024)]:
        blocks_per_seq = -(-ctx // block)
        num_blocks = num_seqs * blocks_per_seq
        cache = [torch.randn(num_blocks, block, kv_heads, dim, device="cuda", dtype=torch.float16) for _ in "kv"]
        tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(num_seqs, blocks_per_seq)
        seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device="cuda")
        query = torch.randn(num_seqs * q_len, heads, dim, device="cuda", dtype=torch.float16)
        args = (query, cache[0], cache[1], tables, seq_lens, qsl, dim**-0.5)
        dense_k = cache[0][tables.long()].view(num_seqs, ctx, kv_heads, dim).transpose(1, 2)
        dense_v = cache[1][tables.long()].view(num_seqs, ctx, kv_heads, dim).transpose(1, 2)
        dense_q = query.view(num_seqs, q_len, heads, dim).transpose(1, 2)

        sdpa = partial(torch.nn.functional.scaled_dot_product_attention, dense_q, dense_k, dense_v,
                       is_causal=q_len > 1, enable_gqa=True)
        kv_bytes = 2 * num_seqs * ctx * kv_heads * dim * 2
        times = {"triton": cuda_time(partial(triton_paged.paged_attention, *args)), "sdpa_contiguous": cuda_time(sdpa),
                 "reference_gather_sdpa": cuda_time(partial(reference.paged_attention, *args), reps=3)}
        rows.append({"num_seqs": num_seqs, "context": ctx, "q_len": q_len,
                     **{f"{k}_ms": round(v * 1e3, 3) for k, v in times.items()},
                     "triton_vs_sdpa": round(times["sdpa_contiguous"] / times["triton"], 2),
                     "triton_kv_pct_of_hbm": round(100 * kv_bytes / times["triton"] / 1e9 / read_gbs, 1)})
    return rows


def swap_case() -> dict[str, Any]:
    """GB/s of KVCache swaps of 1,024 blocks (2 GiB): to and from consecutive swap blocks (one DMA), and to and from
    swap blocks scattered over twice as many (a DMA per run of consecutive ones, most of them one block), beside a
    plain pinned copy of the same bytes."""
    from executor_service.runner.kv_cache import CacheShape, KVCache

    shape = CacheShape(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.float16)
    blocks = 1024
    cache = KVCache(shape, num_device_blocks=blocks, num_swap_blocks=2 * blocks, device=torch.device("cuda"))
    mapping = [(i, i) for i in range(blocks)]
    scattered = list(zip(range(blocks), torch.randperm(2 * blocks)[:blocks].tolist(), strict=True))
    back = [(swap, device) for device, swap in scattered]
    nbytes = blocks * shape.bytes_per_block
    times = {"swap_out": cuda_time(lambda: cache.swap_out(mapping), reps=3),
             "swap_in": cuda_time(lambda: cache.swap_in(mapping), reps=3),
             "swap_out_scattered": cuda_time(lambda: cache.swap_out(scattered), reps=3),
             "swap_in_scattered": cuda_time(lambda: cache.swap_in(back), reps=3)}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = cuda_time(lambda: host.copy_(dev, non_blocking=True), reps=3)
    h2d = cuda_time(lambda: dev.copy_(host, non_blocking=True), reps=3)
    return {"bytes": nbytes, **{f"{k}_gbs": round(nbytes / v / 1e9, 1) for k, v in times.items()},
            "pinned_d2h_gbs": round(nbytes / d2h / 1e9, 1), "pinned_h2d_gbs": round(nbytes / h2d / 1e9, 1)}


def graph_cases(model: str | None, sizes: tuple[int, ...]) -> tuple[list[dict[str, Any]], bool]:
    from executor_service.backend import BatchItem, SamplingConfig
    from executor_service.config import ExecutorConfig
    from executor_service.runner.torch_backend import TorchBackend

    config = ExecutorConfig(model=model, device="cuda", num_gpu_blocks=8 * max(sizes) + 64, num_cpu_blocks=0)
    eager = TorchBackend.create(config)
    config.cuda_graph_sizes = sizes
    graphed = TorchBackend.create(config)
    greedy = SamplingConfig(temperature=0.0)
    rows, same = [], True
    for n in sizes:
        items = [BatchItem(str(i), [3 + (i * 7 + j) % 100 for j in range(100)], 99, 99, 1,
                           list(range(i * 8, i * 8 + 7)), True, greedy) for i in range(n)]
        for backend in (eager, graphed):
            backend.execute([BatchItem(it.request_id, it.token_ids, 99, 0, 99, it.block_table, False, greedy)
                             for it in items])
        tokens = [[o.token_id for o in b.execute(items) if o is not None] for b in (eager, graphed)]
        same &= tokens[0] == tokens[1]
        t_eager = cuda_time(partial(eager.execute, items), reps=10)
        t_graph = cuda_time(partial(graphed.execute, items), reps=10)
        rows.append({"batch": n, "eager_ms": round(t_eager * 1e3, 3), "graph_ms": round(t_graph * 1e3, 3),
                     "speedup": round(t_eager / t_graph, 2), "tokens_equal": tokens[0] == tokens[1]})
    return rows, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face model dir (default: the embedded default model)")
    p.add_argument("--sizes", default=",".join(map(str, GRAPH_SIZES)))
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device", file=sys.stderr)
        return 1
    from executor_service.default_model.model import ensure_default_model

    model_dir = Path(args.model) if args.model else ensure_default_model()
    limits = measure_limits(ModelShape.from_dir(model_dir, dtype_bytes=2), 1, "cuda", bandwidth_mib=4096)
    record: dict[str, Any] = {"bench": "gpu", "device": torch.cuda.get_device_name(),
                              "matmul_peak_tflops_8192": round(device_peak(), 1), "model_limits": limits_record(limits)}
    print(json.dumps(record), flush=True)
    record["attention"] = attention_cases(limits.read_gbs)
    print(json.dumps({"attention": record["attention"]}), flush=True)
    record["swap"] = swap_case()
    print(json.dumps({"swap": record["swap"]}), flush=True)
    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    record["cuda_graphs"], same = graph_cases(str(model_dir), sizes)
    print(json.dumps({"cuda_graphs": record["cuda_graphs"]}), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
