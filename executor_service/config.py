"""Executor service configuration: one dataclass, vLLM's flag names; the flags are derived from it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from client.cpu_cores import parse_cores
from client.flags import add_flags, config_from, flag
from client.switches import SwitchError, env_switch

TP_GROUP = "tensor parallelism (docs/operations.md)"
LAZY_TORCH_IMPORT_ENV = "PAGEDSERVE_LAZY_TORCH_IMPORT"
CONVERTED_CACHE_ENV = "PAGEDSERVE_CONVERTED_CACHE"


def parse_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); '' -> () (off)."""
    try:
        sizes = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, got {text!r}") from None
    if sizes and sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return sizes


def parse_spin_count(text: str) -> int:
    """--cpu-omp-spin-count: -1 (the wait policy's) or a count >= 0."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if count < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (the wait policy's) or >= 0, got {count}")
    return count


@dataclass(slots=True)
class ExecutorConfig:
    listen: str = field(default="127.0.0.1:50061", metadata=flag(
        "HOST:PORT to serve the Executor API on (port 0: a free one, written to --port-file)"))
    port_file: str | None = field(default=None, metadata=flag(
        "file the executor writes the port it bound into, as JSON ({\"listen\": N}), once the port is open"))
    model: str | None = field(default=None, metadata=flag(
        "Hugging Face model directory (default: embedded model)", exclusive="source"))
    simulated: bool = field(default=False, metadata=flag("model-free simulated executor", exclusive="source"))
    draft_model: str | None = field(default=None, metadata=flag(
        "speculative decoding: a draft model directory (the same tokenizer and vocabulary as the model) that "
        "proposes tokens for the scheduler's --speculative-config '{\"method\": \"draft_model\", ...}'; it runs "
        "here, beside the model, over its own KV cache of the same blocks (docs/speculative.md)"))
    device: str = field(default="auto", metadata=flag(choices=["auto", "cuda", "cpu"]))
    dtype: str = field(default="auto", metadata=flag(choices=["auto", "float32", "float16", "bfloat16"]))
    kv_cache_dtype: str = field(default="auto", metadata=flag(
        "the KV cache's element type: auto (the model's dtype) or float16 (half the memory per block, and on the"
        " CPU decode attention reads half the bytes; keys and values rounded as written, as llama.cpp's default"
        " f16 cache does, so greedy outputs may part from transformers' float32 ones; on a GPU only the model's"
        " dtype)", choices=["auto", "float16"]))
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    swap_space: float = field(default=1.0, metadata=flag("CPU swap area in GiB"))
    num_gpu_blocks: int | None = field(default=None, metadata=flag("override the device block count"))
    num_cpu_blocks: int | None = field(default=None, metadata=flag("override the swap block count"))
    cpu_kv_cache_space: float = field(default=1.0, metadata=flag("KV cache size in GiB when the device is the CPU"))
    cpu_weight_prepack: bool = field(default=True, metadata=flag(
        "on the CPU in float32, pack linear weights once for the GEMM (--cpu-gemm; faster linears from 2 rows; one"
        " to two times the weights' memory on top of them)"))
    cpu_gemm: str = field(default="auto", metadata=flag(
        "the packed GEMM for --cpu-weight-prepack: mkl (bit-identical to F.linear from 16 rows), onednn (JIT for"
        " the CPU's ISA: much faster where MKL runs its AVX2 code, as on AMD), or auto (the faster on the model's"
        " shapes, timed at load)", choices=["auto", "mkl", "onednn"]))
    cpu_skinny_rows: int = field(default=-1, metadata=flag(
        "with --cpu-weight-prepack, batches of 2 to N rows take the skinny kernel (AVX-512, or AVX2 and FMA) that"
        " streams weights at memory speed (-1: the most rows at which it beats the packed GEMM on the model's"
        " weights, timed at load; 0: off)"))
    cpu_pack_after_ready: bool = field(default=True, metadata=flag(
        "with --cpu-weight-prepack (and --cpu-gemm or --cpu-skinny-rows auto), pack the linear weights after ready"
        " on a low-priority thread (and measure the choice there where the start-up cache has none), swapped in"
        " between steps (a step over the skinny kernel's rows before then packs the rest itself first); off: pack"
        " before ready"))
    lazy_torch_import: bool = field(default=True, metadata=flag(
        "run the parts of torch's import that an eager forward does not use (its Python meta kernels with"
        " torch._decomp/_prims/_refs, torch.export, torch.nested: 0.3 - 0.5 s of a start) on a low-priority thread"
        " after ready instead of before it; the first use of one of them (torch.compile, meta tensors) runs it at"
        " once. Off for --compile-sizes and tensor parallelism; also off with PAGEDSERVE_LAZY_TORCH_IMPORT=0"))
    cpu_threads: int = field(default=0, metadata=flag(
        "CPU: threads of the forward pass: the C++ kernels' own pool and torch's OpenMP team (torch's ops, MKL,"
        " oneDNN), which take turns; 0: one per core this process may use (affinity mask, cgroup CPU quota)."
        " Tensor parallelism splits the cores between ranks instead"))
    cpu_omp_wait_policy: str = field(default="auto", metadata=flag(
        "CPU: how torch's idle OpenMP threads wait, set before torch loads: auto (poll 10,000 times, 10 - 40 us on"
        " the benchmark box, then sleep, leaving the cores to the kernels' pool, which runs most of a step; an"
        " OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment is kept; BENCHMARKS.md section 17), passive (sleep"
        " at once), active (poll for minutes, also while the server idles: holds cores the kernels' pool needs)",
        choices=["auto", "active", "passive"]))
    cpu_omp_spin_count: int = field(default=-1, metadata=flag(
        "CPU: GOMP_SPINCOUNT, how many times an idle OpenMP thread polls for work before it sleeps (on the"
        " benchmark box 100,000: 0.1 - 0.4 ms, 300,000: ~4 ms), set before torch loads; overrides the wait"
        " policy's (auto 10,000, passive 0, active ~30 billion); -1: the wait policy's", parse=parse_spin_count))
    cpu_huge_pages: bool = field(default=True, metadata=flag(
        "CPU: the KV cache (and the swap area) in transparent huge pages of 2 MiB (MADV_HUGEPAGE): a decode step's"
        " reads of blocks scattered over the cache miss the TLB far less. Needs the kernel's transparent_hugepage at"
        " madvise or always; the cache then takes memory 2 MiB at a time"))
    cpu_populate_kv: bool = field(default=True, metadata=flag(
        "CPU: fault the KV cache's pages in after ready, while no step is in flight (MADV_POPULATE_WRITE), so that"
        " steps do not wait for a fresh page; the executor then holds the whole cache in memory. Off: the cache"
        " takes memory as blocks are first written"))
    cpu_cores: str = field(default="", metadata=flag(
        "CPU: bind the executor to these cores, e.g. 0-3 or 0,2,4 (as vLLM's VLLM_CPU_OMP_THREADS_BIND), leaving"
        " the others to the scheduler side (bind that with taskset or a container cpuset); default: no binding"))
    startup_cache_dir: str | None = field(default=None, metadata=flag(
        "directory of start-up measurements reused by the next start on this machine (the packed GEMM's choice and"
        " the skinny kernel's rows, keyed by the CPU, the builds and the model's shapes; a stale or foreign entry is"
        " measured again); default $PAGEDSERVE_CACHE_DIR/startup or ~/.cache/pagedserve/startup, '' turns it off"))
    converted_weights_cache: bool = field(default=True, metadata=flag(
        "CPU, float32: keep a bfloat16 checkpoint's float32 form in the start-up cache's directory (converted/, 2x"
        " the checkpoint's size on disk) and map it on the next start instead of converting again; a stale, foreign"
        " or truncated one is converted again and rewritten. Also off with PAGEDSERVE_CONVERTED_CACHE=0"))
    max_num_batched_tokens: int = field(default=2048, metadata=flag(
        "most tokens one step may schedule: advertised in Describe, a larger step is refused and the scheduler "
        "caps its own --max-num-batched-tokens to it; CUDA: the size of the forward pass that profiles memory"))
    max_num_seqs: int = field(default=256, metadata=flag(
        "most requests one step may schedule: advertised in Describe, a larger step is refused and the scheduler "
        "caps its own --max-num-seqs to it; CUDA: the rows the profiling pass samples"))
    max_model_len: int | None = None
    seed: int = 0
    kv_window_release: bool = field(default=True, metadata=flag(
        "models with sliding-window layers (Gemma 2/3, GPT-OSS beside full-attention layers; Mistral, Phi-3,"
        " Mixtral, Qwen2 with a window on every layer): the window layers' KV sits in groups of their own tables,"
        " each a ring of ceil(window / block size) + 1 blocks per request that positions reuse (such a model gets"
        " no prefix-cache hits; a model whose every layer slides then holds its rings only); off: one table for"
        " every layer, as for other models, with prefix caching"))
    cuda_graph_sizes: tuple[int, ...] = field(default=(), metadata=flag(
        "decode batch sizes to capture as CUDA graphs, e.g. 1,2,4,8,16,32,64,128,256 (default: none, eager; CUDA "
        "with Triton attention only)", parse=parse_sizes))
    compile_sizes: tuple[int, ...] = field(default=(), metadata=flag(
        "CPU: token counts of steps to run through torch.compile (inductor), one graph each, compiled on first use,"
        " e.g. 1,2,4,8,16; a step runs the smallest size that holds it (default: none, eager; helps small decode"
        " batches only, see BENCHMARKS.md)", parse=parse_sizes))
    step_log: str | None = field(default=None, metadata=flag(
        "append one JSON line per step (sequences, tokens, sampled rows, attended and context keys, passes,"
        " timings) to this file, for benchmarks (benchmarks/vs_transformers.py --step-log)"))
    tensor_parallel_size: int = field(default=1, metadata=flag(
        "shard the model over this many ranks, one process per device (under torchrun: its WORLD_SIZE)",
        group=TP_GROUP, aliases=["-tp"]))
    nnodes: int = field(default=1, metadata=flag("machines the ranks are spread over", group=TP_GROUP))
    node_rank: int = field(default=0, metadata=flag(
        "this machine's index in [0, nnodes); node 0 serves the Executor API", group=TP_GROUP))
    master_addr: str = field(default="127.0.0.1", metadata=flag(
        "address of node 0 for the process group", group=TP_GROUP))
    master_port: int | None = field(default=None, metadata=flag(
        "port on node 0 for the process group (default: a free port on one node, 29500 on several)",
        group=TP_GROUP))
    distributed_timeout: float = field(default=120.0, metadata=flag(
        "seconds a collective may wait for a peer before the executor gives up and exits", group=TP_GROUP))
    sim_vocab_size: int = 32000
    sim_max_model_len: int = 8192
    sim_step_latency_ms: float = 0.0
    sim_token_latency_us: float = 0.0
    sim_eos_rate: float = field(default=0.0, metadata=flag("probability that a simulated token is EOS (0 = never)"))
    sim_eos_token_id: int = 2
    sim_kv_window_groups: int = field(default=0, metadata=flag(
        "simulated: advertise this many sliding-window KV cache groups (a hybrid model's window tables, checked and"
        " released as the torch executor does; 0 = one table)"))
    sim_kv_window: int = field(default=0, metadata=flag("simulated: the window of --sim-kv-window-groups, in tokens"))
    sim_kv_window_ring: bool = field(default=False, metadata=flag(
        "simulated: keep --sim-kv-window-groups' tables as rings of ceil(window / block size) + 1 blocks"
        " (Capabilities.kv_window_ring), as the torch executor does; off: tables released block by block"))
    sim_kv_window_only: bool = field(default=False, metadata=flag(
        "simulated: with --sim-kv-window-groups 1 and --sim-kv-window-ring, a model whose every layer slides"
        " (Capabilities.kv_window_only): no block table is sent (it refuses one), the ring is all a request holds"))
    tls_cert: str | None = field(default=None, metadata=flag("PEM certificate: serve the Executor API over TLS"))
    tls_key: str | None = field(default=None, metadata=flag("PEM private key for --tls-cert"))
    tls_ca: str | None = field(default=None, metadata=flag(
        "PEM CA: require scheduler client certificates it signed (mTLS)"))
    executor_secret_file: str | None = field(default=None, metadata=flag(
        "file holding a shared secret the scheduler must send (its --executor-secret-file); created with a "
        "random secret if it does not exist"))

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> ExecutorConfig:
        """The flags, then the environment's off-switches; a switch's bad value is a usage error naming it."""
        parser = build_parser()
        config = config_from(cls, parser.parse_args(argv))
        try:
            parse_cores(config.cpu_cores)
        except ValueError as e:
            parser.error(f"--cpu-cores: {e}")
        try:
            return apply_switches(config)
        except SwitchError as e:
            parser.error(str(e))


def apply_switches(config: ExecutorConfig, environ: Mapping[str, str] | None = None) -> ExecutorConfig:
    """`config` with the flags the environment turns off (client/switches.py spellings; SwitchError otherwise):
    PAGEDSERVE_LAZY_TORCH_IMPORT=0 as --no-lazy-torch-import, PAGEDSERVE_CONVERTED_CACHE=0 as
    --no-converted-weights-cache. A switch set on leaves its flag as given."""
    lazy = env_switch(LAZY_TORCH_IMPORT_ENV, True, environ)
    converted = env_switch(CONVERTED_CACHE_ENV, True, environ)
    return replace(config, lazy_torch_import=config.lazy_torch_import and lazy,
                   converted_weights_cache=config.converted_weights_cache and converted)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m executor_service", description="pagedserve executor")
    add_flags(p, ExecutorConfig)
    return p
