"""Prefix caching on vs off on the same executor in one run, and n > 1 prompt sharing.

    python benchmarks/prefix_cache.py [--num-prompts 128] [--prefix-len 1024] [--suffix-len 64]
        [--num-prefixes 4] [--output-len 32] [--threads 1] [--skip-serving]

1. Serving (both services as processes on the torch executor, --device cpu by default; the model is
   --model, by default the embedded model's architecture with random weights and 2,048 positions, since
   the trained default stops at 1,024 and these prompts are 1,088 tokens): vLLM's prefix-repetition
   workload from client.bench.datasets -- --num-prompts requests
   over --num-prefixes distinct random prefixes of --prefix-len tokens, each with its own random suffix
   of --suffix-len tokens, --output-len tokens each (greedy, ignore_eos) -- all sent at once, through a
   scheduler with prefix caching on (the default) and then one with --no-enable-prefix-caching, on the
   same executor. Prints median TTFT and output throughput of both and the ratios, with the scheduler's
   vllm:prefix_cache_queries / vllm:prefix_cache_hits.
2. Memory (the pure core, exact): one n = 8 request with a --parallel-prompt-len token prompt and
   --parallel-output-len output tokens vs 8 independent requests with the same prompt sent together;
   the peak number of device blocks each holds, block size 16.
3. Block keys (the pure core, in process; --core-repeats runs, medians): the serving part's requests
   through the scheduler core alone, answered by a fake executor that is not timed -- the time of all its
   schedule() + update() calls (admission look-ups, registering the prompts' blocks, freeing) per request
   -- and the time to compute the block keys of every prompt (block_hash.prefix_keys), per key; CPU time
   of the benchmark's thread (time.thread_time), so that other work on the machine weighs less. This is
   where the block hash costs: the decode steps of benchmarks/scheduler.py hash nothing.
Prints one JSON line per part.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request
from typing import Any

from client.bench.datasets import PrefixRepetitionConfig, prefix_repetition_requests
from client.bench.record import emit, machine
from client.bench.runner import RunConfig, run_benchmark
from client.bench.stats import median
from client.lib import PagedServeClient
from client.local import free_port, parse_metrics, service
from executor_service.default_model.model import ensure_random_model
from scheduler_service.core import block_hash
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

BLOCK_SIZE = 16


def scrape(port: int) -> dict[str, float]:
    return parse_metrics(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())


async def send_all(address: str, requests: list[Any]) -> dict[str, float]:
    async with PagedServeClient(address) as client:
        await run_benchmark(client, requests[:1], RunConfig(ignore_eos=True, show_progress=False))  # warm-up
        result = await run_benchmark(client, requests[1:], RunConfig(ignore_eos=True, show_progress=False))
    ok = [t for t in result.traces if t.success]
    ttfts = [t.chunk_times[0] - t.start for t in ok if t.chunk_times]
    outputs = sum(t.output_len for t in ok)
    return {"completed": len(ok), "failed": len(result.traces) - len(ok), "duration_s": round(result.duration, 2),
            "median_ttft_ms": round(1e3 * median(ttfts), 1),
            "output_throughput_tok_s": round(outputs / result.duration, 1)}


def serving(args: argparse.Namespace) -> dict[str, object]:
    cfg = PrefixRepetitionConfig(num_prompts=args.num_prompts + 1, prefix_len=args.prefix_len,
                                 suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                                 output_len=args.output_len, vocab_size=args.vocab_size, seed=args.seed)
    requests = prefix_repetition_requests(cfg)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    model = args.model or str(ensure_random_model())
    executor_args = ["--model", model, "--device", args.device, "--num-gpu-blocks", str(args.num_gpu_blocks),
                     "--max-num-seqs", str(args.max_num_seqs)]
    record: dict[str, object] = {"part": "serving", "num_prompts": args.num_prompts, "prefix_len": args.prefix_len,
                                 "suffix_len": args.suffix_len, "num_prefixes": args.num_prefixes,
                                 "output_len": args.output_len, "machine": machine()}
    with service("executor_service", executor_args, env=env, name="executor") as executor:
        for name, flags in (("on", []), ("off", ["--no-enable-prefix-caching"])):
            port = free_port()
            sched_args = ["--executor", executor.address, "--metrics-port", str(port),
                          "--max-num-seqs", str(args.max_num_seqs), *flags]
            with service("scheduler_service", sched_args, name=f"scheduler-{name}") as scheduler:
                run = asyncio.run(send_all(scheduler.address, requests))
                m = scrape(port)
            run["prefix_cache_queries"] = m.get("vllm:prefix_cache_queries_total", 0.0)
            run["prefix_cache_hits"] = m.get("vllm:prefix_cache_hits_total", 0.0)
            record[f"caching_{name}"] = run
            print(f"caching {name}: {run}", file=sys.stderr, flush=True)
    on, off = record["caching_on"], record["caching_off"]
    assert isinstance(on, dict) and isinstance(off, dict)
    record["ttft_ratio_on_over_off"] = round(on["median_ttft_ms"] / off["median_ttft_ms"], 3)
    record["throughput_ratio_on_over_off"] = round(on["output_throughput_tok_s"] / off["output_throughput_tok_s"], 2)
    return record


def fake_execute(out: SchedulerOutput) -> ExecutorResult:
    result = ExecutorResult()
    for work in out.scheduled:
        req = work.request
        if req.num_computed_tokens + work.num_tokens >= req.num_tokens:
            result.sampled[req.request_id] = [42]
    return result


def peak_blocks(prompt_len: int, output_len: int, n: int, share: bool) -> int:
    limits = ExecutorLimits(BLOCK_SIZE, num_device_blocks=4096, num_swap_blocks=0,
                         max_model_len=prompt_len + output_len + 16)
    s = Scheduler(CoreConfig(max_num_batched_tokens=16384, watermark=0.0), limits)
    prompt = [10 + i % 200 for i in range(prompt_len)]
    options = SamplingOptions(max_tokens=output_len, ignore_eos=True)
    for i in range(n):
        s.add_request(Request(f"seq{i}", list(prompt), options, 0.0,
                              share_prompt_with="seq0" if share and i else None))
    peak = 0
    while s.has_unfinished():
        out = s.schedule()
        peak = max(peak, s.kv.device.num_used)
        s.update(out, fake_execute(out))
    return peak


def parallel(args: argparse.Namespace) -> dict[str, object]:
    shared = peak_blocks(args.parallel_prompt_len, args.parallel_output_len, 8, share=True)
    independent = peak_blocks(args.parallel_prompt_len, args.parallel_output_len, 8, share=False)
    return {"part": "n=8", "prompt_len": args.parallel_prompt_len, "output_len": args.parallel_output_len,
            "block_size": BLOCK_SIZE, "peak_blocks_n8": shared, "peak_blocks_8_independent": independent,
            "ratio": round(shared / independent, 3)}


def core_keys(args: argparse.Namespace) -> dict[str, object]:
    cfg = PrefixRepetitionConfig(num_prompts=args.num_prompts, prefix_len=args.prefix_len,
                                 suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                                 output_len=args.output_len, vocab_size=args.vocab_size, seed=args.seed)
    prompts = [list(r.prompt_token_ids or ()) for r in prefix_repetition_requests(cfg)]
    limits = ExecutorLimits(BLOCK_SIZE, num_device_blocks=args.num_gpu_blocks, num_swap_blocks=0,
                            max_model_len=args.prefix_len + args.suffix_len + args.output_len + 16)
    options = SamplingOptions(max_tokens=args.output_len, ignore_eos=True)
    perf = time.thread_time_ns  # CPU time of this thread: the other developers' load on the cores stays out
    core_ns, key_ns, steps, hits = [], [], 0, 0
    for _ in range(args.core_repeats):
        s = Scheduler(CoreConfig(max_num_seqs=args.max_num_seqs), limits)
        for i, prompt in enumerate(prompts):
            s.add_request(Request(f"r{i}", list(prompt), options, 0.0))
        spent, steps = 0, 0
        while s.has_unfinished():
            t0 = perf()
            out = s.schedule()
            t1 = perf()
            result = fake_execute(out)
            t2 = perf()
            s.update(out, result)
            spent += perf() - t2 + t1 - t0
            steps += 1
        core_ns.append(spent)
        hits = s.stats().prefix_cache_hits
        t0 = perf()
        for prompt in prompts:
            block_hash.full_blocks(prompt, BLOCK_SIZE)
        key_ns.append(perf() - t0)
    num_keys = sum(len(p) // BLOCK_SIZE for p in prompts)
    return {"part": "block_keys", "num_prompts": args.num_prompts, "prompt_len": args.prefix_len + args.suffix_len,
            "output_len": args.output_len, "steps": steps, "prefix_cache_hits": hits, "repeats": args.core_repeats,
            "core_us_per_request": round(statistics.median(core_ns) / 1e3 / len(prompts), 1),
            "core_ms_total": round(statistics.median(core_ns) / 1e6, 2),
            "key_us_per_block": round(statistics.median(key_ns) / 1e3 / num_keys, 3),
            "keys_us_per_prompt": round(statistics.median(key_ns) / 1e3 / len(prompts), 1), "machine": machine()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=256, help="token ids drawn from [10, this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None,
                   help="model directory (default: the embedded architecture, random weights, 2,048 positions)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the executor")
    p.add_argument("--num-gpu-blocks", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--parallel-prompt-len", type=int, default=1000)
    p.add_argument("--parallel-output-len", type=int, default=32)
    p.add_argument("--core-repeats", type=int, default=5, help="runs of the block-key part (medians)")
    p.add_argument("--skip-serving", action="store_true", help="only the in-process parts (n = 8 memory, block keys)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    emit(parallel(args), args.json_out)
    emit(core_keys(args), args.json_out)
    if not args.skip_serving:
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        emit(serving(args), args.json_out)


if __name__ == "__main__":
    main()
