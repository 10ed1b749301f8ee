"""Executor start-up time (#33): process start to a served first token, cold and warm, with the executor's phases.

    python -m benchmarks.startup [--dtypes float32,bfloat16] [--dir DIR] [--runs 2]

Makes (once, under --dir) a Qwen2-0.5B-shaped random-weight directory per dtype in 4 safetensors shards (hidden
896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings: 494 M parameters,
1.98 GB in float32, 0.99 GB in bfloat16; the embedded model's tokenizer), then for each dtype:

- measures the disk: evicts the shards from the page cache (posix_fadvise DONTNEED, which needs no privileges and
  touches only these files) and reads them once, and prints bytes / that speed as the floor;
- cold: evicts the shards again and removes the executor's start-up cache (under $PAGEDSERVE_CACHE_DIR, a
  directory of this run: the packing choice and a bfloat16 checkpoint's float32 form), starts the executor and a
  scheduler together, and times from the executor's process start to the first token of a one-token greedy
  generation served through the scheduler;
- warm: the same again (files in the page cache, the start-up cache written by the cold start; the executor
  finishes writing it before it exits).

The executor's phase line ("startup phases: ...") and the scheduler's lines about waiting are printed beside each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from client.lib import PagedServeClient
from client.local import ROOT, free_port, start, stop
from executor_service.default_model.model import (
    ModelSpec,
    build_config,
    train_tokenizer,
    weight_shapes,
    write_json,
    write_tokenizer_files,
)

QWEN2_05B = ModelSpec(arch="qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                      num_kv_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True,
                      attention_bias=True, rope_theta=1_000_000.0)
NUM_SHARDS = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_sharded_model(out_dir: Path, spec: ModelSpec, dtype: str, num_shards: int = NUM_SHARDS) -> Path:
    """A random-weight model of `spec` in `dtype`, in num_shards safetensors files with an index (made once)."""
    if (out_dir / "model.safetensors.index.json").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".startup-model-", dir=out_dir.parent))
    gen = torch.Generator().manual_seed(spec.seed)
    shapes = weight_shapes(spec)
    total = sum(torch.Size(s).numel() for _, s in shapes)
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(num_shards)]
    filled, weight_map = 0, {}
    for name, shape in shapes:
        index = min(num_shards - 1, filled * num_shards // total)
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape)
        else:
            tensor = torch.randn(shape, generator=gen).mul_(spec.init_std)
        shards[index][name] = tensor.to(DTYPES[dtype])
        filled += tensor.numel()
        weight_map[name] = f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"
    for i, shard in enumerate(shards):
        save_file(shard, str(tmp / f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"), metadata={"format": "pt"})
    size = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    write_json(tmp / "model.safetensors.index.json", {"metadata": {"total_size": size}, "weight_map": weight_map})
    config = build_config(spec)
    config["dtype"] = dtype
    write_json(tmp / "config.json", config)
    write_tokenizer_files(tmp, spec, train_tokenizer())
    os.rename(tmp, out_dir)
    return out_dir


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def evict(files: list[Path]) -> None:
    """Drop these files' pages from the page cache (clean pages only; nothing else is touched)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_seconds(files: list[Path]) -> tuple[float, int]:
    """Seconds to read these files from the disk (evicted first), and their bytes."""
    evict(files)
    start_t, size = time.perf_counter(), 0
    buf = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                size += n
    return time.perf_counter() - start_t, size


async def first_token(address: str, deadline: float) -> None:
    """One greedy token through the scheduler, retried until it comes."""
    while True:
        try:
            async with PagedServeClient(address) as client:
                async for r in client.generate(prompt_token_ids=[3, 4, 5], max_tokens=1, temperature=0.0,
                                               timeout=30.0):
                    if r.token_ids:
                        return
                    if r.error:
                        raise RuntimeError(r.error)
        except Exception:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.05)


def one_start(model_dir: Path, cache_dir: Path, log_dir: Path, extra: list[str],
              tree: str | None = None) -> tuple[float, str, str]:
    ex_addr, sc_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", PAGEDSERVE_CACHE_DIR=str(cache_dir))  # start-up cache under it
    if tree:  # the executor of another checkout (an A/B against the code before a change), run from its root
        env["PYTHONPATH"] = tree
    log = open(log_dir / "executor.log", "wb")  # noqa: SIM115 - closed with the process
    executor = subprocess.Popen([sys.executable, "-m", "executor_service", "--listen", ex_addr, "--model",
                                 str(model_dir), *extra], cwd=tree or ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    scheduler = start("scheduler_service", ["--listen", sc_addr, "--executor", ex_addr], log_dir / "scheduler.log")
    try:
        asyncio.run(first_token(sc_addr, time.monotonic() + 300))
        seconds = time.monotonic() - t0
    finally:
        stop(scheduler, signal.SIGTERM)
        stop(executor, signal.SIGTERM)
    ex_log = (log_dir / "executor.log").read_text()
    sc_log = (log_dir / "scheduler.log").read_text()
    phases = re.findall(r"startup phases: .*", ex_log)
    waits = [line for line in sc_log.splitlines() if "loading" in line or "WARNING" in line]
    return seconds, phases[-1] if phases else "(no phase line)", "\n      ".join(waits) or "(none)"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "pagedserve-startup-bench"))
    parser.add_argument("--runs", type=int, default=1, help="cold + warm pairs per dtype")
    parser.add_argument("--executor-args", default="", help="extra executor flags, space-separated")
    parser.add_argument("--baseline-tree", default="", help="also start the executor of this checkout (its "
                        "PYTHONPATH), each start right after this tree's, for an A/B within one run")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, threads {torch.get_num_threads()}")
    for dtype in args.dtypes.split(","):
        model_dir = make_sharded_model(root / f"qwen2-0.5b-{dtype}", QWEN2_05B, dtype)
        files = weight_files(model_dir)
        read_s, size = disk_read_seconds(files)
        print(f"\n{dtype}: {len(files)} shards, {size / 1e9:.2f} GB; disk read {read_s:.2f} s "
              f"({size / read_s / 1e9:.2f} GB/s) = the floor")
        results: dict[str, list[float]] = {}
        trees = {"": None, " (baseline)": args.baseline_tree} if args.baseline_tree else {"": None}
        for _ in range(args.runs):
            for label, tree in trees.items():
                cache_dir = root / f"startup-cache-{dtype}"
                shutil.rmtree(cache_dir, ignore_errors=True)
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        evict(files)
                    log_dir = root / f"logs-{dtype}-{kind}{label.strip(' ()')}"
                    log_dir.mkdir(exist_ok=True)
                    seconds, phases, waits = one_start(model_dir, cache_dir, log_dir, args.executor_args.split(),
                                                       tree)
                    results.setdefault(kind + label, []).append(seconds)
                    print(f"  {kind}{label}: first token {seconds:.2f} s ({seconds / read_s:.1f}x the floor)\n"
                          f"      executor: {phases}\n      scheduler: {waits}", flush=True)
        summary = {k: round(min(v), 2) for k, v in results.items()}
        print(f"  best: {json.dumps(summary)}; floor {read_s:.2f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
