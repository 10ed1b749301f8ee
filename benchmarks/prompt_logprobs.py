"""What prompt logprobs cost the torch executor, and that only the requests that ask pay (#30).

    python -m benchmarks.prompt_logprobs [--requests 8] [--prompt-len 128] [--k 5] [--rounds 7]

TorchBackend.execute (in process, no gRPC) on one prefill step of --requests prompts of --prompt-len tokens on the
embedded default model (CPU, float32, one thread): none asks for prompt logprobs, one asks, all ask (top --k). The
three are timed round by round, interleaved, in this thread's CPU time (time.thread_time: other processes on a
shared machine do not count); each prints its best and median and the ratio of its median to the plain step's.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import replace

import torch

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.runner.torch_backend import TorchBackend

GREEDY = SamplingConfig(temperature=0.0)


def step_items(n: int, length: int, vocab: int, block_size: int, asking: int, k: int) -> list[BatchItem]:
    rng = random.Random(n * 1000 + length)
    blocks_each = -(-(length + 1) // block_size)
    items = []
    for i in range(n):
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        sampling = replace(GREEDY, prompt_logprobs=k) if i < asking else GREEDY
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        items.append(BatchItem(str(i), tokens, length, 0, length, table, True, sampling))
    return items


def time_step(backend: TorchBackend, items: list[BatchItem]) -> float:
    t0 = time.thread_time()
    backend.execute(items)
    return time.thread_time() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    blocks = args.requests * (-(-(args.prompt_len + 1) // 16)) + 8
    backend = TorchBackend.create(ExecutorConfig(device="cpu", dtype="float32", num_gpu_blocks=blocks,
                                                 num_cpu_blocks=0, cpu_threads=1))
    vocab = backend.info.vocab_size
    variants = {"none asks": 0, "1 asks": 1, f"all {args.requests} ask": args.requests}
    steps = {name: step_items(args.requests, args.prompt_len, vocab, backend.info.block_size, asking, args.k)
             for name, asking in variants.items()}
    for items in steps.values():
        time_step(backend, items)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, items in steps.items():
            times[name].append(time_step(backend, items))
    print(f"load average {os.getloadavg()[0]:.1f}; prefill step of {args.requests} x {args.prompt_len} tokens, "
          f"vocabulary {vocab}, prompt_logprobs {args.k}, {args.rounds} interleaved rounds (thread CPU time)")
    base = statistics.median(times["none asks"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<12} best {min(values) * 1e3:8.2f} ms  median {median * 1e3:8.2f} ms  "
              f"ratio {median / base:5.3f}")
    backend.wait_for_packing()  # the start-up threads end before the interpreter does


if __name__ == "__main__":
    main()
