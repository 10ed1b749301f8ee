"""What a verification step (speculative decoding) costs the torch executor against a plain decode step (#31).

    python -m benchmarks.verify_cost [--batch 1 8 64] [--context 200] [--drafts 4] [--rounds 9]

TorchBackend.execute (in process, no gRPC) on decode steps of --batch requests with --context tokens each on the
embedded default model (CPU, float32, one thread): a plain step (one token per request) and a step where every
request carries --drafts draft tokens (verified in the same pass), timed round by round, interleaved, in this
thread's CPU time (time.thread_time: other processes on a shared machine do not count). Prints per batch size
both medians, their ratio (the cost ratio the scheduler's adaptivity measures online), the marginal cost of one
draft token as a fraction of a plain step, and the time of the verification's own bookkeeping outside the
forward pass (expand_drafts, verify_rows, verify_requests, accept_runs).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from dataclasses import replace

import torch

from executor_service.backend import BatchItem, SampleOutput, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.runner.speculative import accept_runs, expand_drafts, verify_requests, verify_rows
from executor_service.runner.torch_backend import TorchBackend

GREEDY = SamplingConfig(temperature=0.0)


def decode_items(n: int, length: int, vocab: int, block_size: int, drafts: int) -> list[BatchItem]:
    """n decodes at position length - 1, each with `drafts` random drafts (slots reserved for them)."""
    rng = random.Random(n * 1000 + length)
    blocks_each = -(-(length + drafts + 1) // block_size)
    items = []
    for i in range(n):
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        proposal = tuple(rng.randrange(3, vocab) for _ in range(drafts))
        items.append(BatchItem(str(i), tokens, length, length - 1, 1, table, True, GREEDY, draft_token_ids=proposal))
    return items


def time_step(backend: TorchBackend, items: list[BatchItem]) -> float:
    t0 = time.thread_time()
    backend.execute(items)
    return time.thread_time() - t0


def bookkeeping_s(items: list[BatchItem], repeat: int = 50) -> float:
    """The verification's Python work outside the pass and the sampler, per step."""
    sample_items = list(range(len(items)))
    outputs = [SampleOutput(token_id=0) for _ in range(sum(len(i.draft_token_ids) + 1 for i in items))]
    t0 = time.thread_time()
    for _ in range(repeat):
        expand_drafts(items)
        verify_rows(items, sample_items)
        verify_requests(items, sample_items)
        accept_runs(items, sample_items, outputs)
    return (time.thread_time() - t0) / repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--drafts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    per = -(-(args.context + args.drafts + 1) // 16)
    blocks = max(args.batch) * per + 8
    backend = TorchBackend.create(ExecutorConfig(device="cpu", dtype="float32", num_gpu_blocks=blocks,
                                                 num_cpu_blocks=0, cpu_threads=1))
    vocab, block = backend.info.vocab_size, backend.info.block_size
    print(f"load average {os.getloadavg()[0]:.1f}; decode steps, context {args.context}, {args.drafts} drafts per "
          f"request, {args.rounds} interleaved rounds (thread CPU time)")
    for n in args.batch:
        verify = decode_items(n, args.context, vocab, block, args.drafts)
        plain = [replace(item, draft_token_ids=()) for item in verify]
        time_step(backend, plain), time_step(backend, verify)  # warm-up
        times: dict[str, list[float]] = {"plain": [], "verify": []}
        for _ in range(args.rounds):
            times["plain"].append(time_step(backend, plain))
            times["verify"].append(time_step(backend, verify))
        p, v = statistics.median(times["plain"]), statistics.median(times["verify"])
        print(f"  batch {n:3}: plain {p * 1e3:7.2f} ms  verify {v * 1e3:7.2f} ms  ratio {v / p:5.2f}  "
              f"per draft token {(v - p) / (n * args.drafts) / p:6.3f} plain steps  "
              f"bookkeeping {bookkeeping_s(verify) * 1e6:7.1f} us")
    backend.wait_for_packing()  # the start-up threads end before the interpreter does


if __name__ == "__main__":
    main()
