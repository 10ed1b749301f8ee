"""Executor service configuration: one dataclass, vLLM's flag names."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(slots=True)
class ExecutorConfig:
    listen: str = "127.0.0.1:50061"
    model: str | None = None
    simulated: bool = False
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    cpu_kv_cache_space: float = 1.0
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    cuda_graph_sizes: tuple[int, ...] = ()
    sim_vocab_size: int = 32000
    sim_max_model_len: int = 8192
    sim_step_latency_ms: float = 0.0
    sim_token_latency_us: float = 0.0
    sim_eos_rate: float = 0.0
    sim_eos_token_id: int = 2
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    executor_secret_file: str | None = None

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> ExecutorConfig:
        return cls(**vars(build_parser().parse_args(argv)))


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); '' -> () (CUDA graphs off)."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if sizes and sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"CUDA graph sizes must be positive, got {text!r}")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m executor_service", description="pagedserve executor")
    d = ExecutorConfig()
    p.add_argument("--listen", default=d.listen, help="HOST:PORT to serve the Executor API on")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, help="Hugging Face model directory (default: embedded model)")
    src.add_argument("--simulated", action="store_true", help="model-free simulated executor")
    p.add_argument("--device", default=d.device, choices=["auto", "cuda", "cpu"])
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--swap-space", type=float, default=d.swap_space, help="CPU swap area in GiB")
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="override the device block count")
    p.add_argument("--num-cpu-blocks", type=int, default=None, help="override the swap block count")
    p.add_argument("--cpu-kv-cache-space", type=float, default=d.cpu_kv_cache_space,
                   help="KV cache size in GiB when the device is the CPU")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--cuda-graph-sizes", type=parse_sizes, default=d.cuda_graph_sizes,
                   help="decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16,32,64,128,256"
                   " (default: none, eager; CUDA with Triton attention only)")
    p.add_argument("--sim-vocab-size", type=int, default=d.sim_vocab_size)
    p.add_argument("--sim-max-model-len", type=int, default=d.sim_max_model_len)
    p.add_argument("--sim-step-latency-ms", type=float, default=d.sim_step_latency_ms)
    p.add_argument("--sim-token-latency-us", type=float, default=d.sim_token_latency_us)
    p.add_argument("--sim-eos-rate", type=float, default=d.sim_eos_rate,
                   help="probability that a simulated token is EOS (0 = never)")
    p.add_argument("--sim-eos-token-id", type=int, default=d.sim_eos_token_id)
    p.add_argument("--tls-cert", default=None, help="PEM certificate: serve the Executor API over TLS")
    p.add_argument("--tls-key", default=None, help="PEM private key for --tls-cert")
    p.add_argument("--tls-ca", default=None, help="PEM CA: require scheduler client certificates it signed (mTLS)")
    p.add_argument("--executor-secret-file", default=None,
                   help="file holding a shared secret the scheduler must send (its --executor-secret-file); "
                   "created with a random secret if it does not exist")
    return p
