"""Offline throughput: pagedserve (both services, gRPC, torch executor) vs transformers' continuous batching.

    python -m benchmarks.vs_transformers [--num-requests 128] [--threads 1] [--only pagedserve|transformers]

Both sides get the same model directory and the same request file, and count the same useful work: each
request's own max_tokens output tokens (EOS never stops either side).

- Model: a 33.6M-parameter Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, intermediate 1536, vocab
  8192, random weights) written by executor_service.default_model.model.make_model into --model-dir (made once).
  Requests carry prompt_token_ids, so the tokenizer plays no part.
- Requests: --num-requests ShareGPT-like requests from client.bench.datasets' seeded lognormal generator,
  written to --requests as JSON ({"requests": [{"prompt_token_ids": [...], "max_tokens": n}, ...]}, the
  format `python -m client bench --dataset FILE` reads).
- pagedserve: `python -m executor_service --model DIR --device cpu` and `python -m scheduler_service
  --max-num-seqs M --max-num-batched-tokens B --no-enable-prefix-caching` as processes (caching off, as
  the peer's block sharing is: a repeat must not reuse the previous run's prompt KV); this process submits
  every request at once through client.lib (greedy, ignore_eos) and times from the first submission to the
  last final token.
- transformers, --hf-mode continuous (default): AutoModelForCausalLM in this process with transformers' own
  continuous batching (`continuous_batching_context_manager`: paged cache, per-request max_new_tokens, the
  same --max-num-seqs / --max-num-batched-tokens budgets), every request added at once, greedy, EOS off;
  timed from the first add to the last finished request.
- transformers, --hf-mode static: requests in file order in fixed batches of --hf-batch-size (32),
  left-padded; generate(max_new_tokens = min_new_tokens = the batch's largest max_tokens, greedy): a batch
  finishes together, so rows that asked for fewer tokens keep computing padding.
- --device cpu (default) or cuda for both sides; float32 on both (the executor's default on CPU; on CUDA
  it is passed --dtype float32 so the two sides compute the same thing).
- Torch threads: --threads for both (the executor gets --cpu-threads and OMP_NUM_THREADS; transformers
  torch.set_num_threads).
  On the 2-core development machine 1 is the sane value: pagedserve's scheduler needs the other core, and
  two OpenMP threads on a shared 2-core box thrash (measured 5-9x slower forwards under load).
- The limit (benchmarks/roofline.py), measured first in the same run on the same threads: the matmul peak on
  the model's linear shapes. Each side's model FLOP/s = the FLOPs the requests need (every prompt token and
  every output token but the last through the linears and attention, one LM-head row per output token; no
  recompute or padding counted) / its seconds, printed as a % of that peak.
--step-log FILE: the executor logs every step (executor --step-log) and pagedserve's seconds are broken down by
kind of step (with prefill; decodes of <= 8, 9 - 32, 33 - 64, > 64 sequences) beside those steps' floor: each
step's FLOPs at the matmul peak or its bytes (weights once, its sequences' K/V) at the read bandwidth, the longer.
Each side gets one untimed warm-up request/batch first; with both sides, their --repeats timed runs alternate
(pagedserve, transformers, pagedserve, ...) so that both see the same machine load. Prints useful output
tokens/s of both (medians) and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.roofline import Limits, ModelShape, limits_record, measure_limits
from client.bench.datasets import SyntheticConfig, load_file, synthetic_requests
from client.bench.record import emit, machine
from client.bench.stats import median
from client.local import service

TARGET_RATIO = {"continuous": 5.0, "static": 2.5}
TARGET_PEAK_PCT = 60.0
MODEL_SPEC: dict[str, Any] = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4,
                              "vocab_size": 8192, "max_position_embeddings": 2048, "seed": 0}
DEFAULT_CACHE = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))


def ensure_model(path: Path) -> Path:
    if (path / "config.json").is_file():  # made earlier, or any Hugging Face model directory
        return path
    from executor_service.default_model.model import make_model

    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    make_model(tmp, **MODEL_SPEC)
    if path.exists():  # another run made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, path)
    return path


def write_requests(path: Path, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    cfg = SyntheticConfig(num_prompts=args.num_requests, input_mean=args.input_mean, output_mean=args.output_mean,
                          input_max=args.input_max, output_max=args.output_max, sigma=args.sigma,
                          vocab_size=MODEL_SPEC["vocab_size"], seed=args.seed)
    reqs = synthetic_requests(cfg)
    data = {"requests": [{"prompt_token_ids": list(r.prompt_token_ids or ()), "max_tokens": r.max_tokens}
                         for r in reqs]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return read_requests(path)


def read_requests(path: Path) -> list[tuple[list[int], int]]:
    return [(list(r.prompt_token_ids or ()), r.max_tokens) for r in load_file(path, "json")]


# ---- pagedserve ---------------------------------------------------------------------------------------------

async def drive(address: str, requests: list[tuple[list[int], int]]) -> tuple[float, int, int]:
    """Submit everything at once; (seconds, output tokens received, requests that did not end by length)."""
    from client.lib import PagedServeClient
    from protos.pagedserve.v1 import generation_pb2

    async def one(client: PagedServeClient, ids: list[int], max_tokens: int) -> tuple[int, bool]:
        n, reason = 0, 0
        async for r in client.generate(prompt_token_ids=ids, max_tokens=max_tokens, ignore_eos=True,
                                       temperature=0.0):
            n += len(r.token_ids)
            reason = r.finish_reason or reason
        return n, reason == generation_pb2.FINISH_REASON_LENGTH

    async with PagedServeClient(address) as client:
        await one(client, requests[0][0][:16], 4)  # warm-up, untimed
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, ids, m) for ids, m in requests))
        seconds = time.perf_counter() - t0
    return seconds, sum(n for n, _ in results), sum(1 for _, ok in results if not ok)


def run_pagedserve(model: Path, requests: list[tuple[list[int], int]], args: argparse.Namespace,
                   between: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Timed runs of the services; `between` runs after each (the peer's run, interleaved)."""
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    ex_args = ["--model", str(model), "--device", args.device, "--cpu-kv-cache-space", str(args.cpu_kv_cache_space)]
    if args.device == "cpu":  # the executor sizes its pool by --cpu-threads (default: every core), not OMP_NUM_THREADS
        ex_args += ["--cpu-threads", str(args.threads)]
    if args.num_gpu_blocks:
        ex_args += ["--num-gpu-blocks", str(args.num_gpu_blocks)]
    if args.device == "cuda":
        ex_args += ["--dtype", "float32"]
    # The executor's per-step limits (Describe) cap the scheduler's budgets: give it the same ones.
    ex_args += ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    ex_args += shlex.split(args.executor_args)
    if args.step_log is not None:
        args.step_log.unlink(missing_ok=True)
        ex_args += ["--step-log", str(args.step_log)]
    # Prefix caching off: a repeat would otherwise reuse the previous run's prompt KV (the peer shares no blocks).
    sc_flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--no-enable-prefix-caching"]
    runs = []
    with service("executor_service", ex_args, env=env, name="executor") as ex:
        sc_args = ["--executor", ex.address, "--metrics-port", "-1", *sc_flags]
        with service("scheduler_service", sc_args, name="scheduler") as sc:
            if args.device == "cuda":  # untimed: one-off compiles and allocations (the peer warms up on two requests)
                asyncio.run(drive(sc.address, requests))
            for _ in range(args.repeats):
                seconds, tokens, bad = asyncio.run(drive(sc.address, requests))
                runs.append({"seconds": seconds, "output_tokens": tokens, "not_length": bad})
                between()
        log_tail = ex.log.read_text(errors="replace").splitlines()[-3:]
    useful = sum(m for _, m in requests)
    for r in runs:
        if r["output_tokens"] != useful or r["not_length"]:
            raise RuntimeError(f"pagedserve returned {r['output_tokens']} tokens, expected {useful}: {log_tail}")
    seconds = median([r["seconds"] for r in runs])
    return {"seconds": seconds, "runs": [round(r["seconds"], 2) for r in runs], "useful_tokens": useful,
            "useful_tokens_per_s": useful / seconds, "executor_flags": ex_args[2:],
            "scheduler_flags": sc_flags}


# ---- transformers ---------------------------------------------------------------------------------------------

def load_hf(model_dir: Path, args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()  # type: ignore[arg-type]


Peer = tuple[Callable[[], float], dict[str, Any]]


def continuous_peer(model_dir: Path, requests: list[tuple[list[int], int]], args: argparse.Namespace) -> Peer:
    """(one timed run, what describes it), after an untimed warm-up."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = load_hf(model_dir, args)
    gen = GenerationConfig(max_new_tokens=max(m for _, m in requests), do_sample=False, eos_token_id=-1,
                           pad_token_id=0)
    page = 256
    blocks = sum(-(-(len(ids) + m) // page) for ids, m in requests) + 8
    # transformers 5.17 calls the page size block_size; 5.25 calls it page_size
    size_name = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
    settings: dict[str, Any] = {size_name: page, "num_blocks": blocks, "max_batch_tokens": args.max_num_batched_tokens,
                                "max_requests_per_batch": args.max_num_seqs, "allow_block_sharing": False}
    cb = ContinuousBatchingConfig(**settings)

    def generate(batch: list[tuple[list[int], int]]) -> tuple[float, int]:
        with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                       block=True, timeout=30) as manager:
            t0 = time.perf_counter()
            for i, (ids, m) in enumerate(batch):
                manager.add_request(list(ids), request_id=f"r{i}", max_new_tokens=m)
            tokens = finished = 0
            while finished < len(batch):
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching loop stopped")
                    continue
                if result.is_finished():
                    finished += 1
                    tokens += len(result.generated_tokens)
            return time.perf_counter() - t0, tokens

    generate([(requests[0][0][:16], 4)] * 2)  # warm-up, untimed
    useful = sum(m for _, m in requests)

    def once() -> float:
        seconds, tokens = generate(requests)
        if tokens != useful:
            raise RuntimeError(f"transformers generated {tokens} tokens, expected {useful}")
        return seconds

    return once, {"mode": "continuous", "max_requests_per_batch": args.max_num_seqs,
                  "max_batch_tokens": args.max_num_batched_tokens}


def static_peer(model_dir: Path, requests: list[tuple[list[int], int]], args: argparse.Namespace) -> Peer:
    import torch

    model = load_hf(model_dir, args)
    device = model.device
    pad = 0
    batches = [requests[i:i + args.hf_batch_size] for i in range(0, len(requests), args.hf_batch_size)]

    def generate(batch: list[tuple[list[int], int]]) -> int:
        width = max(len(ids) for ids, _ in batch)
        new = max(m for _, m in batch)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch], device=device)
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        if out.shape[1] != width + new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, asked for {new}")
        return len(batch) * new

    generate([(requests[0][0][:16], 4)] * 2)  # warm-up, untimed

    def once() -> float:
        t0 = time.perf_counter()
        for b in batches:
            generate(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    computed = sum(len(b) * max(m for _, m in b) for b in batches)
    return once, {"mode": "static", "computed_output_tokens": computed,
                  "useful_fraction": sum(m for _, m in requests) / computed,
                  "padded_prompt_tokens": sum(len(b) * max(len(ids) for ids, _ in b) for b in batches),
                  "batch_size": args.hf_batch_size}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_CACHE / "bench-llama-32m")
    p.add_argument("--requests", type=Path, default=None,
                   help="request file (JSON) to use if it exists, else to write; by default one is generated "
                   "into the temp directory from the flags below")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--input-mean", type=float, default=64.0)
    p.add_argument("--input-max", type=int, default=256)
    p.add_argument("--output-mean", type=float, default=64.0)
    p.add_argument("--output-max", type=int, default=256)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="both sides on this device (float32 either way, so the comparison stays like for like)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per side (the median is used)")
    p.add_argument("--hf-mode", choices=["continuous", "static"], default="continuous",
                   help="transformers' continuous batching (generate_batch's manager) or static generate batches")
    p.add_argument("--hf-batch-size", type=int, default=32, help="batch size of --hf-mode static")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--cpu-kv-cache-space", type=float, default=1.0, help="executor KV cache GiB")
    p.add_argument("--num-gpu-blocks", type=int, default=0, help="override the executor's KV block count (0: off)")
    p.add_argument("--executor-args", default="", help="more executor flags, e.g. '--cpu-gemm mkl'")
    p.add_argument("--only", choices=["pagedserve", "transformers"], default=None)
    p.add_argument("--step-log", type=Path, default=None,
                   help="have the executor log every step here (--step-log) and print where pagedserve's time goes:"
                   " seconds per kind of step against that step's floor at the measured limits")
    p.add_argument("--target-ratio", type=float, default=None,
                   help="the ratio to meet (default: 5 against continuous batching, 2.5 against static)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    model = ensure_model(args.model_dir)
    if args.requests is not None and args.requests.is_file():
        requests = read_requests(args.requests)
        source = str(args.requests)
    else:
        tag = "-".join(f"{getattr(args, k):g}" for k in ("num_requests", "input_mean", "input_max", "output_mean",
                                                       "output_max", "sigma", "seed"))
        path = args.requests or Path(tempfile.gettempdir()) / f"pagedserve-vs-hf-{tag}.json"
        requests = write_requests(path, args)
        source = str(path)
    prompt = [len(ids) for ids, _ in requests]
    output = [m for _, m in requests]
    shape = {"requests": len(requests), "request_file": source, "prompt_mean": sum(prompt) / len(prompt),
             "prompt_max": max(prompt), "output_mean": sum(output) / len(output), "output_max": max(output),
             "useful_tokens": sum(output)}
    model_shape = ModelShape.from_dir(model)
    flops = sum(model_shape.request_flops(len(ids), m) for ids, m in requests)
    limits = measure_limits(model_shape, args.threads, args.device)
    emit({"bench": "vs_transformers", "machine": machine(), "model": str(model), "threads": args.threads,
          "device": args.device, "model_gflop": round(flops / 1e9, 1), "limits": limits_record(limits),
          **shape}, args.json_out)
    results: dict[str, dict[str, Any]] = {}
    peer_runs: list[float] = []
    once: Callable[[], float] | None = None
    if args.only != "pagedserve":
        once, info = (continuous_peer if args.hf_mode == "continuous" else static_peer)(model, requests, args)
    if args.only != "transformers":
        between = (lambda: peer_runs.append(once())) if once is not None else (lambda: None)
        results["pagedserve"] = with_flops(run_pagedserve(model, requests, args, between), flops, limits)
        emit({"bench": "vs_transformers", "side": "pagedserve", **results["pagedserve"]}, args.json_out)
        if args.step_log is not None:
            for row in step_breakdown(args.step_log, model_shape, limits, args.repeats):
                emit({"bench": "vs_transformers", "side": "pagedserve", **row}, args.json_out)
    elif once is not None:
        peer_runs = [once() for _ in range(args.repeats)]
    if once is not None:
        useful = sum(m for _, m in requests)
        seconds = median(peer_runs)
        peer = {**info, "seconds": seconds, "runs": [round(r, 2) for r in peer_runs], "useful_tokens": useful,
                "useful_tokens_per_s": useful / seconds}
        results["transformers"] = with_flops(peer, flops, limits)
        emit({"bench": "vs_transformers", "side": "transformers", **results["transformers"]}, args.json_out)
    if len(results) == 2:
        summarize(results, args, limits)


STEP_KINDS = ((8, "decode <= 8 seqs"), (32, "decode 9 - 32 seqs"), (64, "decode 33 - 64 seqs"),
              (None, "decode > 64 seqs"))


def step_kind(step: dict[str, int]) -> str:
    if step["tokens"] > step["seqs"]:
        return "with prefill"
    return next(name for most, name in STEP_KINDS if most is None or step["seqs"] <= most)


def step_breakdown(path: Path, shape: ModelShape, limits: Limits, runs: int) -> list[dict[str, Any]]:
    """Per kind of step (and all together), per timed run: steps, executor seconds, and the floor those steps
    have at the measured limits (each step's FLOPs at the matmul peak or its bytes at the read bandwidth, the
    longer; benchmarks/roofline.py), from the executor's step log (the warm-up request's few steps included)."""
    sums: dict[str, list[float]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        step = json.loads(line)
        if not step["seqs"]:
            continue
        flops = shape.step_flops(step["tokens"], step["sampled"], step["attended"]) * step["passes"]
        moved = shape.step_bytes(step["tokens"], step["context"], step["sampled"]) * step["passes"]
        floor = limits.floor_seconds(flops, moved)
        for kind in (step_kind(step), "all"):
            total = sums.setdefault(kind, [0, 0.0, 0.0])
            total[0] += 1
            total[1] += step["total_ns"] / 1e9
            total[2] += floor
    order = ["with prefill", *(name for _, name in STEP_KINDS), "all"]
    return [{"steps": kind, "count": round(n / runs), "seconds": round(seconds / runs, 2),
             "floor_seconds": round(floor / runs, 2), "x_floor": round(seconds / floor, 2)}
            for kind in order if kind in sums for n, seconds, floor in [sums[kind]]]


def with_flops(result: dict[str, Any], flops: float, limits: Limits) -> dict[str, Any]:
    gflops = flops / result["seconds"] / 1e9
    return {**result, "model_gflops": round(gflops, 1), "pct_of_matmul_peak": round(limits.flops_pct(gflops * 1e9), 1)}


def summarize(results: dict[str, dict[str, Any]], args: argparse.Namespace, limits: Limits) -> None:
    ours, theirs = results["pagedserve"], results["transformers"]
    ratio = ours["useful_tokens_per_s"] / theirs["useful_tokens_per_s"]
    target = args.target_ratio or TARGET_RATIO[args.hf_mode]
    emit({"bench": "vs_transformers", "ratio": round(ratio, 2), "target": target, "target_met": ratio >= target,
          "pct_of_matmul_peak": ours["pct_of_matmul_peak"], "target_pct": TARGET_PEAK_PCT,
          "machine_after": machine()}, args.json_out)
    name = "continuous" if args.hf_mode == "continuous" else f"static b={args.hf_batch_size}"
    print(f"\nmatmul peak measured first: {limits.matmul_peak_gflops:.1f} GFLOP/s ({args.threads} thread(s); by GEMM"
          f" {limits.matmul_gflops_by_gemm})\n"
          f"| side | useful output tokens/s | seconds | model GFLOP/s (% of peak) |\n| --- | --- | --- | --- |\n"
          f"| pagedserve | {ours['useful_tokens_per_s']:.1f} | {ours['seconds']:.1f} | "
          f"{ours['model_gflops']:.1f} ({ours['pct_of_matmul_peak']:.0f}%) |\n"
          f"| transformers {name} | {theirs['useful_tokens_per_s']:.1f} | {theirs['seconds']:.1f} | "
          f"{theirs['model_gflops']:.1f} ({theirs['pct_of_matmul_peak']:.0f}%) |\n"
          f"ratio {ratio:.2f}x (target >= {target}x: {'met' if ratio >= target else 'MISSED'}); pagedserve at "
          f"{ours['pct_of_matmul_peak']:.0f}% of the matmul peak (target >= {TARGET_PEAK_PCT:.0f}%)")


if __name__ == "__main__":
    main()
