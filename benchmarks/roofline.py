"""The hardware limit a benchmark's model work is compared with, measured in the same run.

Model work is counted from the config, not profiled: per computed token, 2 FLOPs per weight of every linear
layer (fused qkv, o, fused gate/up, down); per sampled row, 2 x hidden x vocab for the LM head; per query token
and layer, 4 x heads x head_dim FLOPs per attended key (QK^T and PV). A decode step moves the linear and LM-head
weights once, reads the K/V of every attended key and writes the K/V of each new token.

The limits are measured on the benchmark's own threads: matmul peak = the best FLOP/s of one layer's linears plus
the LM head at M rows (M = 64 ... 512, the model's own shapes, best of several timings), over torch's F.linear
and, on the CPU in float32, over each packed GEMM the executor can use (MKL's, oneDNN's), the best of them all
(on AMD CPUs MKL runs its AVX2 code and oneDNN is 2 - 2.5x faster; the per-GEMM peaks are reported beside it);
memory bandwidth = a
streaming read of a buffer much larger than the caches (and a copy, reported beside it).

    python -m benchmarks.roofline [--model DIR] [--threads 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from executor_service.backend import attended_keys

PEAK_ROWS = (64, 128, 256, 512)
BANDWIDTH_MIB = 512


@dataclass(slots=True, frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 4

    @classmethod
    def from_dir(cls, model_dir: Path, dtype_bytes: int = 4) -> ModelShape:
        from executor_service.model import ModelConfig

        c = ModelConfig.from_dir(model_dir)
        moe = c.features.moe  # a sparse MLP counts as the intermediate rows one token runs through (FLOPs)
        inter = c.intermediate_size if moe is None else moe.intermediate_size * moe.top_k + moe.shared_intermediate_size
        return cls(c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, inter, c.vocab_size,
                   dtype_bytes)

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) of one layer's linears: fused qkv, o, fused gate/up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * self.intermediate),
                (self.intermediate, self.hidden)]

    @property
    def linear_flops_per_token(self) -> int:
        return 2 * self.layers * sum(i * o for i, o in self.linears())

    @property
    def lm_head_flops_per_row(self) -> int:
        return 2 * self.hidden * self.vocab

    @property
    def lm_head_bytes(self) -> int:
        return self.hidden * self.vocab * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """Linear and LM-head weights: what every forward pass reads once."""
        per_layer = sum(i * o for i, o in self.linears())
        return self.layers * per_layer * self.dtype_bytes + self.lm_head_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def attention_flops(self, start: int, num_tokens: int) -> int:
        """Causal attention of positions [start, start + num_tokens): position p attends to p + 1 keys."""
        return self.attended_flops(attended_keys(start, num_tokens))

    def attended_flops(self, keys: int) -> int:
        """QK^T and PV of queries that attend to `keys` keys in all, in every layer."""
        return 4 * self.heads * self.head_dim * self.layers * keys

    def pass_flops(self, start: int, num_tokens: int, sampled: bool) -> int:
        """One request's part of one forward pass."""
        return (num_tokens * self.linear_flops_per_token + self.attention_flops(start, num_tokens)
                + (self.lm_head_flops_per_row if sampled else 0))

    def request_flops(self, prompt_len: int, output_len: int) -> int:
        """A whole request without recompute: every prompt token and every output token but the last goes
        through the model; one LM-head row per output token."""
        computed = prompt_len + output_len - 1
        return (computed * self.linear_flops_per_token + self.attention_flops(0, computed)
                + output_len * self.lm_head_flops_per_row)

    def step_flops(self, tokens: int, sampled: int, attended: int) -> int:
        """A forward pass of `tokens` tokens whose queries attend to `attended` keys, `sampled` rows sampled."""
        return (tokens * self.linear_flops_per_token + sampled * self.lm_head_flops_per_row
                + self.attended_flops(attended))

    def step_bytes(self, tokens: int, context: int, sampled: int) -> int:
        """Bytes a pass must move at least: the weights once (the LM head's only if it samples a row), the K/V of
        its sequences' `context` keys read once and the `tokens` new ones written."""
        weights = self.weight_bytes if sampled else self.weight_bytes - self.lm_head_bytes
        return weights + (context + tokens) * self.kv_bytes_per_token

    def decode_step_bytes(self, context_lens: Iterable[int]) -> int:
        """Bytes a decode step moves: weights once, K/V of every attended key read, one token's K/V written."""
        lens = list(context_lens)
        return self.weight_bytes + (sum(lens) + len(lens)) * self.kv_bytes_per_token


@dataclass(slots=True)
class Limits:
    device: str
    threads: int
    matmul_peak_gflops: float
    matmul_gflops_by_rows: dict[int, float]
    matmul_gflops_by_gemm: dict[str, float]
    read_gbs: float
    copy_gbs: float

    def flops_pct(self, flops_per_s: float) -> float:
        return 100.0 * flops_per_s / (self.matmul_peak_gflops * 1e9)

    def bandwidth_pct(self, bytes_per_s: float) -> float:
        return 100.0 * bytes_per_s / (self.read_gbs * 1e9)

    def floor_seconds(self, flops: float, moved: float) -> float:
        """The least time a pass can take here: its FLOPs at the matmul peak or its bytes at the read bandwidth,
        whichever is longer (compute and memory traffic perfectly overlapped)."""
        return max(flops / (self.matmul_peak_gflops * 1e9), moved / (self.read_gbs * 1e9))


def best_time(fn: Callable[[], object], sync: Callable[[], None], reps: int, rounds: int = 5,
              clock: Callable[[], float] = time.perf_counter) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(rounds):
        t0 = clock()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (clock() - t0) / reps)
    return best


def measure_limits(shape: ModelShape, threads: int, device: str = "cpu", rows: Iterable[int] = PEAK_ROWS,
                   bandwidth_mib: int = BANDWIDTH_MIB, clock: Callable[[], float] = time.perf_counter) -> Limits:
    """Matmul peak on the model's linear shapes and streaming memory bandwidth, on `threads` torch threads.
    clock=time.thread_time (one thread, CPU) counts only this thread's CPU time: robust on a shared machine."""
    import torch

    from executor_service.model.packed import dense

    torch.set_num_threads(threads)
    dev = torch.device(device)
    dtype = {2: torch.float16, 4: torch.float32}[shape.dtype_bytes]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    shapes = [*shape.linears(), (shape.hidden, shape.vocab)]
    weights = [torch.randn(o, i, device=dev, dtype=dtype) for i, o in shapes]
    gemms = cpu_gemms(weights) if dev.type == "cpu" and dtype == torch.float32 else {}
    by_rows: dict[int, float] = {}
    by_gemm: dict[str, float] = {}
    with torch.inference_mode():
        for m in rows:
            inputs = [torch.randn(m, i, device=dev, dtype=dtype) for i, _ in shapes]
            flops = sum(2 * m * i * o for i, o in shapes)
            for name, packs in {"torch": [None] * len(weights), **gemms}.items():

                def layer(inputs: list[torch.Tensor] = inputs, packs: list[Any] = packs) -> None:
                    for x, w, p in zip(inputs, weights, packs, strict=True):
                        dense(x, w, None, p)

                gflops = flops / best_time(layer, sync, reps=3, clock=clock) / 1e9
                by_rows[m] = max(by_rows.get(m, 0.0), gflops)
                by_gemm[name] = round(max(by_gemm.get(name, 0.0), gflops), 1)
        numel = bandwidth_mib * (1 << 20) // 4
        src = torch.rand(numel, device=dev)
        dst = torch.empty_like(src)
        read = best_time(src.sum, sync, reps=1, rounds=4, clock=clock)
        copy = best_time(lambda: dst.copy_(src), sync, reps=1, rounds=4, clock=clock)
    return Limits(device=dev.type, threads=threads, matmul_peak_gflops=max(by_rows.values()),
                  matmul_gflops_by_rows={m: round(v, 1) for m, v in by_rows.items()}, matmul_gflops_by_gemm=by_gemm,
                  read_gbs=numel * 4 / read / 1e9, copy_gbs=2 * numel * 4 / copy / 1e9)


def cpu_gemms(weights: list[Any]) -> dict[str, list[Any]]:
    """The weights packed for each packed CPU GEMM that can run here (executor_service/model/packed.py)."""
    from executor_service.model import packed

    return {g: [packed.pack(w, g) for w in weights] for g in packed.GEMMS if packed.available(g)}


def limits_record(limits: Limits) -> dict[str, object]:
    record = asdict(limits)
    for key in ("matmul_peak_gflops", "read_gbs", "copy_gbs"):
        record[key] = round(record[key], 1)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model dir (default: the embedded default model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    from executor_service.default_model.model import ensure_default_model

    shape = ModelShape.from_dir(args.model or ensure_default_model())
    print(json.dumps({"bench": "roofline", "shape": asdict(shape),
                      **limits_record(measure_limits(shape, args.threads, args.device))}))


if __name__ == "__main__":
    main()
