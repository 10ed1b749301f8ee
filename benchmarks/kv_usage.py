"""KV-cache slot utilisation of paged allocation vs static (up-front) reservation, on one request trace.

    python benchmarks/kv_usage.py [--num-requests 1000] [--num-gpu-blocks 2000] [--block-size 16]

Driven in-process at the core level (the pure scheduler_service.core.Scheduler, as in the service, with
its real KVCacheManager, chunked prefill, preemption and swap), with a fake executor that answers each step
the way an executor must: one token for every request whose scheduled tokens complete its known tokens.
Each request has a ShareGPT-like prompt length and true output length (client.bench.datasets' seeded
lognormal generator); it asks for max_tokens = --max-tokens (the cap a client would send) and stops by EOS
at its true output length, which the fake executor emits there.

Sampled every step, after schedule() has allocated the step's blocks, over the device-resident requests:
    paged  = sum(tokens computed or being computed) / sum(blocks held * block_size)
and, for the same requests at the same step, what a static-batching system that reserves KV space up front
would hold:
    static-max    = the same tokens / sum(prompt + max_tokens)          (reserves for the cap)
    static-oracle = the same tokens / sum(prompt + true output length)  (knows every output length)
vLLM's paper (SOSP'23, fig. 2) reports 96.3% for vLLM and 20.4% - 38.2% for static systems.
Also printed: how full the device pool is (allocated / all blocks), and the same requests run by a simple
Orca-style simulation that reserves up front (its own admissions, so its own running batch): its
utilisation, mean batch and the steps it needs, next to pagedserve's.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

from client.bench.datasets import SyntheticConfig, synthetic_requests
from client.bench.record import emit, machine
from client.bench.stats import percentile
from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, RequestStatus, SamplingOptions
from scheduler_service.core.scheduler import Scheduler

EOS = 2
TOKEN = 42
TARGET = 0.95
PAPER_VLLM = 0.963
PAPER_STATIC = (0.204, 0.382)


@dataclass
class Trace:
    """Per-step sums over the requests holding device blocks."""

    used: list[int] = field(default_factory=list)
    held: list[int] = field(default_factory=list)
    static_max: list[int] = field(default_factory=list)
    static_oracle: list[int] = field(default_factory=list)
    occupancy: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)


def fake_execute(out: SchedulerOutput, target_len: dict[str, int]) -> ExecutorResult:
    """A token for every request whose scheduled tokens complete its known tokens; EOS at its true length."""
    result = ExecutorResult()
    for work in out.scheduled:
        req = work.request
        if req.num_computed_tokens + work.num_tokens >= req.num_tokens:
            last = req.num_output_tokens + 1 >= target_len[req.request_id]
            result.sampled[req.request_id] = [EOS if last else TOKEN]
    return result


def sample(sched: Scheduler, out: SchedulerOutput, trace: Trace, max_tokens: int, target_len: dict[str, int]) -> None:
    scheduled = {w.request.request_id: w.num_tokens for w in out.scheduled}
    blocks, bs = sched.kv, sched.limits.block_size
    used = held = smax = soracle = 0
    for r in sched.running:
        if r.status is not RequestStatus.RUNNING:
            continue
        rid = r.request_id
        used += r.num_computed_tokens + scheduled.get(rid, 0)
        held += len(blocks.block_table(rid)) * bs
        smax += r.num_prompt_tokens + max_tokens
        soracle += r.num_prompt_tokens + target_len[rid]
    trace.used.append(used)
    trace.held.append(held)
    trace.static_max.append(smax)
    trace.static_oracle.append(soracle)
    trace.occupancy.append(blocks.device.num_used / blocks.device.num_blocks)
    trace.running.append(len(sched.running))


def simulate(args: argparse.Namespace) -> tuple[Trace, dict[str, Any]]:
    cfg = SyntheticConfig(num_prompts=args.num_requests, input_mean=args.input_mean, output_mean=args.output_mean,
                          input_max=args.input_max, output_max=args.output_max, sigma=args.sigma, seed=args.seed)
    reqs = synthetic_requests(cfg)
    config = CoreConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        preemption_mode=PreemptionMode(args.preemption_mode), watermark=args.watermark)
    limits = ExecutorLimits(block_size=args.block_size, num_device_blocks=args.num_gpu_blocks,
                         num_swap_blocks=args.num_cpu_blocks, max_model_len=args.input_max + args.max_tokens + 8,
                         eos_token_ids=(EOS,))
    sched = Scheduler(config, limits)
    target_len: dict[str, int] = {}
    options = SamplingOptions(max_tokens=args.max_tokens)
    now = time.monotonic()
    for i, br in enumerate(reqs):
        rid = f"req-{i}"
        target_len[rid] = min(br.max_tokens, args.max_tokens)
        sched.add_request(Request(rid, list(br.prompt_token_ids or ()), options, now))
    trace = Trace()
    steps = 0
    t0 = time.perf_counter()
    finished_tokens = 0
    while sched.has_unfinished():
        out = sched.schedule()
        sample(sched, out, trace, args.max_tokens, target_len)
        deltas = sched.update(out, fake_execute(out, target_len))
        for d in deltas:
            if d.finish_reason is not None and d.error:
                raise RuntimeError(f"{d.request_id} failed: {d.error}")
            finished_tokens += len(d.new_token_ids)
        steps += 1
        if steps > 10_000_000:
            raise RuntimeError("simulation does not finish")
    stats = sched.stats()
    info = {"steps": steps, "seconds": time.perf_counter() - t0, "output_tokens": finished_tokens,
            "expected_output_tokens": sum(target_len.values()),
            "preemptions_swap": stats.num_preemptions_swap, "preemptions_recompute": stats.num_preemptions_recompute,
            "mean_prompt": sum(r.prompt_len for r in reqs) / len(reqs),
            "mean_output": sum(target_len.values()) / len(reqs),
            "prompt_lens": [r.prompt_len for r in reqs],
            "output_lens": [target_len[f"req-{i}"] for i in range(len(reqs))]}
    return trace, info


def simulate_static(prompts: list[int], outputs: list[int], reserve: list[int], slots: int, max_num_seqs: int,
                    max_batched_tokens: int) -> dict[str, float]:
    """An Orca-style system on the same requests: iteration-level batching, but each request reserves
    `reserve` slots up front (contiguous, so no block rounding) and holds them until it finishes.
    FCFS admission while the reservation fits; a prompt is prefilled in one step; one token per step after."""
    waiting = list(range(len(prompts)))
    waiting.reverse()
    running: dict[int, int] = {}  # request -> tokens in cache after this step
    reserved = steps = 0
    used_sum = reserved_sum = batch_sum = 0
    while waiting or running:
        budget = max_batched_tokens - len(running)
        for i in list(running):
            running[i] += 1
        while waiting and len(running) < max_num_seqs:
            i = waiting[-1]
            if reserved + reserve[i] > slots or prompts[i] > budget:
                break
            waiting.pop()
            reserved += reserve[i]
            budget -= prompts[i]
            running[i] = prompts[i]
        if not running:
            raise RuntimeError("a request's reservation exceeds the pool")
        steps += 1
        used_sum += sum(running.values())
        reserved_sum += reserved
        batch_sum += len(running)
        for i, n in list(running.items()):
            if n - prompts[i] + 1 >= outputs[i]:  # this step sampled its last token
                del running[i]
                reserved -= reserve[i]
    return {"steps": steps, "utilisation": used_sum / reserved_sum, "mean_batch": batch_sum / steps}


def ratios(num: list[int], den: list[int], keep: list[bool]) -> dict[str, float]:
    """Token-weighted ratio over kept steps, and the mean / p5 / min of per-step ratios."""
    pairs = [(a, b) for a, b, k in zip(num, den, keep, strict=True) if k and b > 0]
    per_step = [a / b for a, b in pairs]
    total = sum(b for _, b in pairs)
    return {"weighted": sum(a for a, _ in pairs) / total if total else float("nan"),
            "mean": sum(per_step) / len(per_step) if per_step else float("nan"),
            "p5": percentile(per_step, 0.05), "min": min(per_step) if per_step else float("nan"),
            "steps": len(per_step)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--input-mean", type=float, default=161.0, help="ShareGPT's mean prompt length (vLLM paper)")
    p.add_argument("--output-mean", type=float, default=338.0, help="ShareGPT's mean output length (vLLM paper)")
    p.add_argument("--input-max", type=int, default=1024)
    p.add_argument("--output-max", type=int, default=1024)
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of both lengths")
    p.add_argument("--max-tokens", type=int, default=1024, help="max_tokens each request sends (static-max cap)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-gpu-blocks", type=int, default=2000)
    p.add_argument("--num-cpu-blocks", type=int, default=2000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--preemption-mode", choices=[m.value for m in PreemptionMode], default="auto")
    p.add_argument("--watermark", type=float, default=0.01)
    p.add_argument("--full-threshold", type=float, default=0.9,
                   help="steps with device pool occupancy >= this count as 'cache full'")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.output_max > args.max_tokens:
        p.error("--output-max must be <= --max-tokens (a request never outputs more than it asks for)")
    trace, info = simulate(args)
    every = [True] * len(trace.used)
    full = [o >= args.full_threshold for o in trace.occupancy]
    slots = args.num_gpu_blocks * args.block_size
    mean_running = sum(trace.running) / len(trace.running)
    record: dict[str, object] = {"bench": "kv_usage", "machine": machine(), "config": {
        k: getattr(args, k) for k in ("num_requests", "input_mean", "output_mean", "input_max", "output_max", "sigma",
                                      "max_tokens", "seed", "num_gpu_blocks", "num_cpu_blocks", "block_size",
                                      "max_num_seqs", "max_num_batched_tokens", "preemption_mode")}, **info}
    for label, keep in (("all_steps", every), ("cache_full_steps", full)):
        record[label] = {
            "paged": ratios(trace.used, trace.held, keep),
            "static_max": ratios(trace.used, trace.static_max, keep),
            "static_oracle": ratios(trace.used, trace.static_oracle, keep),
        }
    record["mean_occupancy"] = sum(trace.occupancy) / len(trace.occupancy)
    record["mean_running_paged"] = mean_running
    prompts, outputs = info.pop("prompt_lens"), info.pop("output_lens")
    for label, reserve in (("static_max", [n + args.max_tokens for n in prompts]),
                           ("static_oracle", [n + m for n, m in zip(prompts, outputs, strict=True)])):
        record[f"{label}_system"] = simulate_static(prompts, outputs, reserve, slots, args.max_num_seqs,
                                                    args.max_num_batched_tokens)
    paged = record["all_steps"]["paged"]["weighted"]  # type: ignore[index]
    static_max = record["all_steps"]["static_max"]["weighted"]  # type: ignore[index]
    static_oracle = record["all_steps"]["static_oracle"]["weighted"]  # type: ignore[index]
    record["ratio_paged_to_static_max"] = paged / static_max
    record["ratio_paged_to_static_oracle"] = paged / static_oracle
    record["target"] = TARGET
    record["target_met"] = paged >= TARGET
    emit(record, args.json_out)
    print(f"\n{info['steps']} steps, {args.num_requests} requests (prompt mean {info['mean_prompt']:.0f}, output mean "
          f"{info['mean_output']:.0f}), pool {args.num_gpu_blocks} x {args.block_size} slots, mean occupancy "
          f"{record['mean_occupancy']:.1%}, preemptions swap/recompute {info['preemptions_swap']}/"
          f"{info['preemptions_recompute']}, simulated in {info['seconds']:.1f}s")
    print("| steps | paged (tokens / allocated slots) | static, reserve prompt+max_tokens | "
          "static, reserve prompt+true output | paged / static-max | paged / static-oracle |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label in ("all_steps", "cache_full_steps"):
        r = record[label]
        pg, sm, so = r["paged"], r["static_max"], r["static_oracle"]  # type: ignore[index]
        print(f"| {label} ({pg['steps']}) | {pg['weighted']:.1%} (p5 {pg['p5']:.1%}) | {sm['weighted']:.1%} | "
              f"{so['weighted']:.1%} | {pg['weighted'] / sm['weighted']:.2f}x | "
              f"{pg['weighted'] / so['weighted']:.2f}x |")
    print("\nThe same requests run by an Orca-style system that reserves up front (its own batches):")
    print("| system | slot utilisation | mean running batch | steps to finish the trace |")
    print("| --- | --- | --- | --- |")
    print(f"| pagedserve (paged) | {paged:.1%} | {mean_running:.1f} | {info['steps']} |")
    for label in ("static_max", "static_oracle"):
        r = record[f"{label}_system"]
        print(f"| {label} | {r['utilisation']:.1%} | {r['mean_batch']:.1f} | {r['steps']} |")  # type: ignore[index]
    print(f"target paged >= {TARGET:.0%}: {'met' if record['target_met'] else 'MISSED'}; "
          f"paper: vLLM {PAPER_VLLM:.1%}, static {PAPER_STATIC[0]:.1%}-{PAPER_STATIC[1]:.1%}")


if __name__ == "__main__":
    main()
