"""Does a test's batch preempt however its requests arrive? The scheduler core (pure, in process) runs the batch
with each request arriving at a random step in [0, D], in random order, over an executor that answers every step
at once; for each spread D it prints in how many of the trials nothing was preempted, and the fewest preemptions.

A batch sent "at once" reaches the engine spread out on a loaded box (the api servers relay it, grammars compile
one by one); an e2e test that asserts preemption should pass this for D up to a good part of a request's life.
Steps, not seconds: the core runs synchronously here (no async scheduling, no speculation), so the figures are
the block arithmetic of FCFS admission and latest-admitted victims, not a timing.

    python scripts/arrival_spread.py --prompts 100,60,33,17,7,1 --max-tokens 48 --blocks 24 --spreads 0,8,16,32
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

MAX_STEPS = 1_000_000


@dataclass(frozen=True)
class Batch:
    prompts: list[list[int]]
    max_tokens: int
    n: list[int]  # sequences of each request
    blocks: int
    swap_blocks: int
    block_size: int
    config: CoreConfig


def answer(out: SchedulerOutput) -> ExecutorResult:
    """A token for every request whose known tokens are all computed after the step."""
    result = ExecutorResult()
    for work in out.scheduled:
        request = work.request
        if request.num_computed_tokens + work.num_tokens >= request.num_tokens:
            result.sampled[request.request_id] = [7] * out.num_steps
    return result


def add_arrivals(s: Scheduler, batch: Batch, due: list[int], step: int) -> None:
    options = SamplingOptions(max_tokens=batch.max_tokens, ignore_eos=True)
    for i in due:
        for j in range(batch.n[i]):
            s.add_request(Request(f"r{i}.{j}", list(batch.prompts[i]), options, float(step),
                                  share_prompt_with=f"r{i}.0" if j else None))


def preemptions(batch: Batch, arrivals: list[int]) -> tuple[int, int]:
    """Preemptions (by swap, by recompute) of the batch with request i arriving at step arrivals[i]."""
    limits = ExecutorLimits(batch.block_size, batch.blocks, batch.swap_blocks, max_model_len=1 << 20,
                            eos_token_ids=(2,))
    s = Scheduler(batch.config, limits)
    step = 0
    while step <= max(arrivals) or s.has_unfinished():
        add_arrivals(s, batch, [i for i, a in enumerate(arrivals) if a == step], step)
        out = s.schedule()
        s.update(out, answer(out))
        step += 1
        if step > MAX_STEPS:
            raise RuntimeError("the batch never finished")
    stats = s.stats()
    return stats.num_preemptions_swap, stats.num_preemptions_recompute


def sweep(batch: Batch, spread: int, trials: int) -> list[tuple[int, int]]:
    counts = []
    for t in range(trials if spread else 1):
        rng = random.Random(t)
        counts.append(preemptions(batch, [rng.randint(0, spread) for _ in batch.prompts]))
    return counts


def make_prompts(lengths: list[int]) -> list[list[int]]:
    """Distinct prompts (no shared cached prefix) of the given lengths."""
    return [[1000 + i] + [5 + (7 * i + k) % 50 for k in range(n - 1)] for i, n in enumerate(lengths)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", required=True, help="prompt lengths, comma-separated (one request each)")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--n", default="1", help="sequences per request: one for all, or one per prompt, comma-separated")
    p.add_argument("--blocks", type=int, required=True, help="device KV blocks")
    p.add_argument("--swap-blocks", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--preemption-mode", choices=[m.value for m in PreemptionMode], default="recompute")
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--spreads", default="0,4,8,16,32", help="largest arrival steps D, comma-separated")
    p.add_argument("--trials", type=int, default=200)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = CoreConfig(preemption_mode=PreemptionMode(args.preemption_mode), watermark=args.watermark,
                        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=args.prefix_caching)
    lengths = [int(x) for x in args.prompts.split(",")]
    n = [int(x) for x in args.n.split(",")]
    batch = Batch(make_prompts(lengths), args.max_tokens, n * len(lengths) if len(n) == 1 else n, args.blocks,
                  args.swap_blocks, args.block_size, config)
    for spread in (int(x) for x in args.spreads.split(",")):
        counts = sweep(batch, spread, args.trials)
        totals = [swap + recompute for swap, recompute in counts]
        none = sum(t == 0 for t in totals)
        print(f"D={spread:4d}: no preemption in {none}/{len(counts)} trials; fewest {min(totals)}, most {max(totals)}; "
              f"fewest by swap {min(c[0] for c in counts)}, by recompute {min(c[1] for c in counts)}")


if __name__ == "__main__":
    main()
