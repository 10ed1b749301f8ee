"""Sliding-window KV cache groups: the blocks a long request holds for a model's window layers.

    python -m benchmarks.sliding_window [--context 8192] [--window 512] [--block-size 16] [--chunk 512]
        [--models gemma2,mistral]

Each random-weight model (transformers writes it, small dims so it runs on a CPU) -- a Gemma 2 (alternating window
and full-attention layers) and a Mistral whose every layer slides (Capabilities.kv_window_only) -- is served twice
in this process, with the same KV memory: by the torch backend with window groups (--kv-window-release, the
default: each window group's table a ring of ceil(W / block_size) + 1 blocks; the Mistral's one group holds every
layer and no block table) and without (one table for every layer). Each request (prompt of
--context minus --new-tokens tokens, then --new-tokens greedy tokens) goes through the real scheduler core, the
Execute message, the executor's validator and the torch backend, as in tests/executor/test_kv_window_groups.py.

Printed per request: the most blocks its window layers held at once (the window group's table; without the
release, its whole table), in prefill-chunk steps and in decode steps, against ceil(W / block_size) + 1; the
most blocks of the pool (in pages of the same bytes) it held; whether the greedy tokens are the same both ways;
and how many such requests fit in the same KV memory with and without the release (the pool divided by one
request's peak, in bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from client.bench.record import emit, machine
from executor_service.backend import BackendInfo
from executor_service.config import ExecutorConfig
from executor_service.runner.torch_backend import TorchBackend
from executor_service.server import ExecutorServicer
from protos.pagedserve.v1 import executor_pb2
from scheduler_service.core.config import CoreConfig
from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.executor_link import result_from_proto, step_proto
from scheduler_service.engine.executor_loop import executor_limits

NUM_LAYERS = 4


@dataclass
class Peaks:
    """One request's most blocks held at once: its window layers' table (all of it, and in decode steps), and
    every table it holds, in pages."""

    window: int = 0
    window_prefill: int = 0
    window_decode: int = 0
    pages: int = 0
    tokens: list[int] = field(default_factory=list)


def write_model(path: Path, name: str, window: int, context: int) -> Path:
    """A Gemma 2 (window layers beside full-attention ones) or a Mistral (every layer slides) of NUM_LAYERS."""
    import transformers

    torch.manual_seed(5)
    common: dict[str, Any] = {
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": window,
        "max_position_embeddings": context + 64, "initializer_range": 0.2, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0}
    config = transformers.Gemma2Config(**common, query_pre_attn_scalar=16) if name == "gemma2" \
        else transformers.MistralConfig(**common)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


Served = tuple[BackendInfo, int, dict[str, Peaks], float]
"""One serving: the backend's info, the layers one page holds, each request's peaks, the wall seconds."""


async def serve(backend: TorchBackend, prompts: dict[str, list[int]], new_tokens: int, chunk: int) -> dict[str, Peaks]:
    servicer = ExecutorServicer(backend)
    describe = await servicer.Describe(executor_pb2.DescribeRequest(), None)
    limits = replace(executor_limits(describe), max_model_len=max(map(len, prompts.values())) + new_tokens)
    s = Scheduler(CoreConfig(max_num_batched_tokens=chunk, enable_prefix_caching=False), limits)
    peaks = {rid: Peaks() for rid in prompts}
    for rid, prompt in prompts.items():
        s.add_request(Request(rid, prompt, SamplingOptions(temperature=0.0, max_tokens=new_tokens, ignore_eos=True),
                              0.0))
    while s.has_unfinished():
        out = s.schedule()
        for r in s.running:
            record(s, r, peaks[r.request_id])
        result = await servicer.run_step(step_proto(out))
        if result.error or result.errors:
            raise RuntimeError(f"step refused: {result.error or list(result.errors)}")
        for delta in s.update(out, result_from_proto(result, out)):
            peaks[delta.request_id].tokens += delta.new_token_ids
    return peaks


def record(s: Scheduler, request: Request, peaks: Peaks) -> None:
    rid = request.request_id
    table = s.kv.window_table(rid)
    window = table.length if table is not None else len(s.kv.block_table(rid))
    peaks.window = max(peaks.window, window)
    if request.num_computed_tokens >= request.num_prompt_tokens:
        peaks.window_decode = max(peaks.window_decode, window)
    else:
        peaks.window_prefill = max(peaks.window_prefill, window)
    peaks.pages = max(peaks.pages, s.kv.num_blocks_held(rid))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: the prefill chunk")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=0.25, help="KV memory of each executor")
    p.add_argument("--models", default="gemma2,mistral", help="comma-separated: gemma2 (hybrid), mistral (all slide)")
    p.add_argument("--json-out")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    generator = torch.Generator().manual_seed(3)
    prompt_len = args.context - args.new_tokens
    prompts = {f"r{i}": torch.randint(3, 512, (prompt_len,), generator=generator).tolist()
               for i in range(args.requests)}
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = write_model(Path(tmp) / name, name, args.window, args.context)
            results: dict[bool, Served] = {}
            for release in (True, False):
                config = ExecutorConfig(model=str(path), device="cpu", block_size=args.block_size, num_cpu_blocks=0,
                                        cpu_kv_cache_space=args.kv_gib, max_num_batched_tokens=args.chunk, seed=0,
                                        kv_window_release=release)
                backend = TorchBackend.create(config)
                t0 = time.perf_counter()
                peaks = asyncio.run(serve(backend, prompts, args.new_tokens, args.chunk))
                results[release] = (backend.info, backend.layout.page_layers, peaks, time.perf_counter() - t0)
        report(args, name, results)


def report(args: argparse.Namespace, name: str, results: dict[bool, Served]) -> None:
    bound = -(-args.window // args.block_size) + 1
    on_info, _, on, on_s = results[True]
    _, _, off, off_s = results[False]
    layers_per_page = {release: layers for release, (_, layers, _, _) in results.items()}
    for rid in on:
        emit({"bench": "sliding_window", "model": name, "window_only": on_info.kv_window_only, "request": rid,
              "context": args.context, "window": args.window,
              "block_size": args.block_size, "chunk": args.chunk, "bound_ceil_w_over_bs_plus_1": bound,
              "window_blocks_peak": on[rid].window, "window_blocks_peak_prefill": on[rid].window_prefill,
              "window_blocks_peak_decode": on[rid].window_decode, "within_bound": on[rid].window <= bound,
              "window_blocks_peak_release_off": off[rid].window,
              "pages_peak": on[rid].pages, "pages_peak_release_off": off[rid].pages,
              "same_greedy_tokens": on[rid].tokens == off[rid].tokens, "tokens": len(on[rid].tokens)})
    # one request's peak in bytes: pages of layers_per_page layers each
    per_request = {release: max(p.pages for p in peaks.values()) * layers_per_page[release]
                   for release, (_, _, peaks, _) in results.items()}
    pool = {release: info.num_device_blocks * layers_per_page[release]
            for release, (info, _, _, _) in results.items()}
    fits = {release: pool[release] // per_request[release] for release in results}
    emit({"bench": "sliding_window", "model": name, "summary": True, "kv_gib": args.kv_gib,
          "pool_layer_blocks": pool[True], "request_layer_blocks_peak": per_request[True],
          "request_layer_blocks_peak_release_off": per_request[False],
          "concurrent_requests_fit": fits[True], "concurrent_requests_fit_release_off": fits[False],
          "ratio": round(fits[True] / max(1, fits[False]), 2), "seconds": round(on_s, 1),
          "seconds_release_off": round(off_s, 1), **machine()}, args.json_out)


if __name__ == "__main__":
    main()
