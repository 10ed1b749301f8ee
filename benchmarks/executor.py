"""Decode tokens/s of the torch executor through the Executor gRPC API, beside transformers' generate.

    python -m benchmarks.executor [--batch-sizes 1,16,64] [--steps 32] [--prompt-len 32] [--model DIR]
                                  [--device auto|cpu|cuda] [--threads 1] [--repeats 3] [--json-out FILE]
                                  [--executor-args '--compile-sizes 1,16,64']

Both sides use the same weights: --model DIR, or the embedded default model (a 4-layer, hidden-256 Llama,
made once and cached). Prompts are the same N seeded random prompts of --prompt-len tokens for both.

- pagedserve: `python -m executor_service --model DIR` as a process, driven directly over one Execute bidi
  stream (no scheduler). One step prefills the N requests, 2 untimed decode steps warm up, then K decode
  steps (RunningRequests column diffs, greedy, a new block handed over whenever a table fills) are timed from the
  first write to the last read. tokens/s = N * K / that time. Also shown: the executor's own busy time
  (sum of StepResult.timings.total_ns), i.e. tokens/s with the gRPC round trip taken out, and "async": the same
  steps with the next one written before the last one's result is read (two in flight, as the scheduler's
  default async scheduling drives the executor), so the round trip overlaps the executor's work.
- transformers: AutoModelForCausalLM in this process, eager PyTorch, a batch of the same N prompts (all the
  same length, so no padding), greedy, EOS disabled. Decode time of K tokens = time of
  generate(max_new_tokens=K+1) - time of generate(max_new_tokens=1) (the prefill and first token).
- Each figure is the median of --repeats runs after one untimed warm-up run.
- Torch threads: --threads for both (the executor gets OMP_NUM_THREADS, transformers torch.set_num_threads).
  On a small shared machine 1 is the sane value.
- The limit, measured first in the same run on the same threads (benchmarks/roofline.py): the matmul peak on
  the model's linear shapes and the streaming-read memory bandwidth. Beside each tokens/s: the model FLOP/s it
  implies (linears + LM head + attention over each step's context) as a % of that peak, and the bytes a decode
  step moves (weights once + K/V read and written) per second as a % of the measured bandwidth.
Prints a table of tokens/s and the ratio pagedserve / transformers per batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc

from benchmarks.roofline import Limits, ModelShape, limits_record, measure_limits
from client.local import ROOT, free_port, stop, wait_healthy
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc

WARMUP_STEPS = 2
GREEDY = common_pb2.SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass
class Row:
    batch: int
    steps: int
    pagedserve_tok_s: float
    executor_busy_tok_s: float
    pagedserve_async_tok_s: float
    transformers_tok_s: float
    flops_per_token: float = 0.0
    bytes_per_token: float = 0.0

    @property
    def ratio(self) -> float:
        return self.pagedserve_tok_s / self.transformers_tok_s

    @property
    def async_ratio(self) -> float:
        return self.pagedserve_async_tok_s / self.transformers_tok_s

    def gflops(self, tok_s: float) -> float:
        return tok_s * self.flops_per_token / 1e9

    def gbs(self, tok_s: float) -> float:
        return tok_s * self.bytes_per_token / 1e9


def decode_work(shape: ModelShape, batch: int, prompt_len: int, steps: int) -> tuple[float, float]:
    """(FLOPs, bytes) per generated token over the timed decode steps (contexts grow from prompt + warm-up)."""
    contexts = [prompt_len + WARMUP_STEPS + 1 + k for k in range(steps)]
    flops = sum(batch * shape.pass_flops(c - 1, 1, True) for c in contexts)
    moved = sum(shape.decode_step_bytes([c] * batch) for c in contexts)
    return flops / (batch * steps), moved / (batch * steps)


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def start_executor(args: argparse.Namespace, model_dir: Path, num_blocks: int, log: Path
                   ) -> tuple[str, subprocess.Popen[bytes]]:
    address = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, "-m", "executor_service", "--listen", address, "--model", str(model_dir),
           "--device", args.device, "--block-size", str(args.block_size), "--num-gpu-blocks", str(num_blocks),
           "--num-cpu-blocks", "0", *shlex.split(args.executor_args)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(address, proc, timeout=300.0)
    except BaseException:
        stop(proc)
        sys.stderr.write(log.read_text(errors="replace")[-3000:])
        raise
    return address, proc


def decode_steps(lengths: list[int], tables: list[list[int]], next_block: int, count: int, block_size: int
                 ) -> list[executor_pb2.StepRequest]:
    """`count` decode steps of every request (RunningRequests columns), a new block whenever a table fills."""
    steps = []
    for _ in range(count):
        msg = executor_pb2.StepRequest()
        for i in range(len(lengths)):
            # The token sampled last step sits at position lengths[i]; it needs a slot now.
            new: list[int] = []
            if lengths[i] + 1 > len(tables[i]) * block_size:
                new = [next_block]
                tables[i].append(next_block)
                next_block += 1
            lengths[i] += 1
            msg.running.request_ids.append(str(i))
            msg.running.num_scheduled_tokens.append(1)
            msg.running.num_new_blocks.append(len(new))
            msg.running.new_block_ids.extend(new)
        steps.append(msg)
    return steps


def prefill_steps(batch: list[list[int]], block_size: int, budget: int
                  ) -> tuple[list[executor_pb2.StepRequest], list[list[int]], int]:
    """The batch's prompts as new requests, whole, in as few steps as fit `budget` tokens each (the executor's
    max_num_batched_tokens; the requests already sent sit those steps out); their block tables; the next free
    block."""
    steps: list[executor_pb2.StepRequest] = []
    tables: list[list[int]] = []
    next_block = scheduled = 0
    for i, prompt in enumerate(batch):
        if not steps or scheduled + len(prompt) > budget:
            steps.append(executor_pb2.StepRequest())
            scheduled = 0
        blocks = -(-len(prompt) // block_size)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        scheduled += len(prompt)
        steps[-1].new_requests.append(executor_pb2.NewRequest(
            request_id=str(i), token_ids=prompt, num_prompt_tokens=len(prompt), num_computed_tokens=0,
            num_scheduled_tokens=len(prompt), block_ids=tables[i], sampling=GREEDY))
    return steps, tables, next_block


async def executor_run(stub: executor_pb2_grpc.ExecutorStub, batch: list[list[int]], steps: int,
                       block_size: int, in_flight: int = 1) -> tuple[float, float]:
    """(wall seconds, executor busy seconds) of `steps` decode steps of the batch on a fresh stream, with up
    to `in_flight` steps sent before their results are read (2: the scheduler's async scheduling)."""
    call = stub.Execute()
    step_id = 0

    async def send(msg: executor_pb2.StepRequest) -> None:
        nonlocal step_id
        step_id += 1
        msg.step_id = step_id
        await call.write(msg)

    async def receive() -> executor_pb2.StepResult:
        result = await call.read()
        if result is grpc.aio.EOF or result.error or result.errors:
            raise RuntimeError(f"a step failed: {result}")
        return result

    try:
        budget = (await stub.Describe(executor_pb2.DescribeRequest())).capabilities.max_num_batched_tokens
        prefills, tables, next_block = prefill_steps(batch, block_size, budget)
        for msg in prefills:
            await send(msg)
            await receive()
        lengths = [len(p) for p in batch]
        for msg in decode_steps(lengths, tables, next_block, WARMUP_STEPS, block_size):
            await send(msg)
            await receive()
        timed = decode_steps(lengths, tables, 1 + max(max(t) for t in tables), steps, block_size)
        busy = 0.0
        t0 = time.perf_counter()
        for k, msg in enumerate(timed):
            await send(msg)
            if k + 1 >= in_flight:
                busy += (await receive()).timings.total_ns / 1e9
        for _ in range(min(in_flight - 1, len(timed))):
            busy += (await receive()).timings.total_ns / 1e9
        return time.perf_counter() - t0, busy
    finally:
        call.cancel()


async def bench_executor(address: str, batch_sizes: list[int], args: argparse.Namespace,
                         vocab: int) -> dict[int, tuple[float, float, float]]:
    """Per batch size: tokens/s with one step in flight, the executor's busy tokens/s, tokens/s with two."""
    out: dict[int, tuple[float, float, float]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        await executor_run(stub, prompts(1, args.prompt_len, vocab), 4, args.block_size)  # warm-up
        for n in batch_sizes:
            batch = prompts(n, args.prompt_len, vocab)
            runs, pipelined = [], []
            for _ in range(args.repeats):  # alternated, so that both modes see the same load
                runs.append(await executor_run(stub, batch, args.steps, args.block_size))
                pipelined.append(await executor_run(stub, batch, args.steps, args.block_size, in_flight=2))
            wall = statistics.median(r[0] for r in runs)
            busy = statistics.median(r[1] for r in runs)
            wall_async = statistics.median(r[0] for r in pipelined)
            out[n] = (n * args.steps / wall, n * args.steps / busy, n * args.steps / wall_async)
            print(f"  pagedserve  batch {n:>3}: {out[n][0]:9.1f} tok/s, {out[n][2]:9.1f} with 2 steps in flight",
                  file=sys.stderr, flush=True)
    return out


def bench_transformers(model_dir: Path, batch_sizes: list[int], args: argparse.Namespace, vocab: int
                       ) -> dict[int, float]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    dtype = torch.float32 if device == "cpu" else torch.float16
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()  # type: ignore[arg-type]

    def timed(ids: Any, new_tokens: int) -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        if device == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == ids.shape[1] + new_tokens
        return time.perf_counter() - t0

    out: dict[int, float] = {}
    for n in batch_sizes:
        ids = torch.tensor(prompts(n, args.prompt_len, vocab), device=device)
        timed(ids, 4)  # warm-up
        decode = [timed(ids, args.steps + 1) - timed(ids, 1) for _ in range(args.repeats)]
        out[n] = n * args.steps / statistics.median(decode)
        print(f"  transformers batch {n:>3}: {out[n]:9.1f} tok/s", file=sys.stderr, flush=True)
    return out


def table(rows: list[Row], header: dict[str, Any], limits: Limits) -> str:
    lines = [", ".join(f"{k}={v}" for k, v in header.items()),
             f"limits (measured first, {limits.threads} thread(s)): matmul peak {limits.matmul_peak_gflops:.1f} GFLOP/s"
             f" (by rows {limits.matmul_gflops_by_rows}; by GEMM {limits.matmul_gflops_by_gemm}), read"
             f" {limits.read_gbs:.1f} GB/s, copy {limits.copy_gbs:.1f} GB/s", "",
             f"{'batch':>5} | {'pagedserve tok/s':>16} | {'executor busy tok/s':>19} | {'async tok/s':>11} | "
             f"{'transformers tok/s':>18} | {'ratio':>6} | {'async':>6} | {'GFLOP/s (% peak) ours / theirs':>30} | "
             f"{'GB/s (% bw) ours / theirs':>26}",
             "-" * 165]
    for r in rows:
        ours, theirs = r.pagedserve_tok_s, r.transformers_tok_s
        flops = (f"{r.gflops(ours):.1f} ({limits.flops_pct(r.gflops(ours) * 1e9):.0f}%) / "
                 f"{r.gflops(theirs):.1f} ({limits.flops_pct(r.gflops(theirs) * 1e9):.0f}%)")
        moved = (f"{r.gbs(ours):.1f} ({limits.bandwidth_pct(r.gbs(ours) * 1e9):.0f}%) / "
                 f"{r.gbs(theirs):.1f} ({limits.bandwidth_pct(r.gbs(theirs) * 1e9):.0f}%)")
        lines.append(f"{r.batch:>5} | {ours:>16.1f} | {r.executor_busy_tok_s:>19.1f} | "
                     f"{r.pagedserve_async_tok_s:>11.1f} | {theirs:>18.1f} | {r.ratio:>5.2f}x | "
                     f"{r.async_ratio:>5.2f}x | {flops:>30} | {moved:>26}")
    lines.append("ratio = pagedserve (through Execute, gRPC round trip included, one step in flight) / transformers"
                 " generate; async = the same with the next step sent before the last one's result is read (the"
                 " scheduler's default async scheduling); GFLOP/s and GB/s of the one-in-flight run")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--model", default=None, help="Hugging Face model dir (default: the embedded default model)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads for each side")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executor-args", default="", help="more executor flags, e.g. '--compile-sizes 1,16,64'")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x]
    if not batch_sizes or min(batch_sizes) < 1 or args.steps < 1 or args.prompt_len < 1:
        p.error("batch sizes, --steps and --prompt-len must be positive")

    from executor_service.default_model.model import ensure_random_model
    from executor_service.model import ModelConfig

    model_dir = Path(args.model) if args.model else ensure_random_model()
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda_available()) else "cpu"
    shape = ModelShape.from_dir(model_dir, dtype_bytes=2 if device == "cuda" else 4)
    limits = measure_limits(shape, args.threads, device)
    per_request = -(-(args.prompt_len + WARMUP_STEPS + args.steps + 1) // args.block_size)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-executor-") as tmp:
        address, proc = start_executor(args, model_dir, max(batch_sizes) * per_request, Path(tmp) / "executor.log")
        try:
            with grpc.insecure_channel(address) as channel:
                describe = executor_pb2_grpc.ExecutorStub(channel).Describe(executor_pb2.DescribeRequest())
            ours = asyncio.run(bench_executor(address, batch_sizes, args, vocab))
        finally:
            stop(proc)
    theirs = bench_transformers(model_dir, batch_sizes, args, vocab)
    rows = [Row(n, args.steps, *ours[n], theirs[n], *decode_work(shape, n, args.prompt_len, args.steps))
            for n in batch_sizes]
    header = {"model": describe.model_id, "device": describe.device, "dtype": describe.dtype,
              "prompt_len": args.prompt_len, "steps": args.steps, "threads": args.threads,
              "repeats": args.repeats, "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2)}
    print(table(rows, header, limits))
    if args.json_out:
        rows_out = [{**asdict(r), "ratio": r.ratio, "async_ratio": r.async_ratio} for r in rows]
        record = {**header, "limits": limits_record(limits), "rows": rows_out}
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
