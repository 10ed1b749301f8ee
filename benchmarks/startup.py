"""Executor start-up time (#33): process start to a served first token, cold and warm, with the executor's phases.

    python -m benchmarks.startup [--dtypes float32,bfloat16] [--dir DIR] [--runs 2] [--disk-gbps G]

Makes (once, under --dir) a Qwen2-0.5B-shaped random-weight directory per dtype in 4 safetensors shards (hidden
896, 24 layers, 14 heads / 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings: 494 M parameters,
1.98 GB in float32, 0.99 GB in bfloat16; the embedded model's tokenizer), then for each dtype:

- measures two floors. This box is a virtual machine whose disk is a file on its host, read through the host's page
  cache: posix_fadvise(DONTNEED) (no privileges needed, touches only these files) empties the guest's cache of the
  shards, not the host's. So the shards are evicted and read READS times: the first read comes from the disk where
  the host has not kept them (it drops them within minutes here: 0.39 - 0.47 GB/s on files idle for 18 min - 2 h),
  the later ones from the host's cache (1.2 - 1.9 GB/s; a freshly written file reads as fast: the host caches
  writes too, so no file made here is sure to come from the disk). Printed: every read, then
  * the disk floor: the first read, if it was at least DISK_FACTOR x slower than the best later one (else the host
    held the files before the run, the disk was not seen, and --disk-gbps, where given, sets it): the issue's
    "time to read the files at the machine's measured disk speed", its warm target's reference;
  * the host-cached floor: the best later read (the guest's cache cold, the host's warm), what a cold start meets
    here, since the floor's reads leave the files in the host's cache;
- cold: evicts the shards from the guest's cache again and removes the executor's start-up cache (under
  $PAGEDSERVE_CACHE_DIR, a directory of this run: the packing choice and a bfloat16 checkpoint's float32 form),
  starts the executor and a scheduler together, and times from the executor's process start to the first token of
  a one-token greedy generation served through the scheduler;
- warm: the same again (files in the page cache, the start-up cache written by the cold start; the executor
  finishes writing it before it exits).

Each start is printed with its ratio to both floors, the executor's phase line ("startup phases: ...") and the
scheduler's lines about waiting.
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
from dataclasses import dataclass
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


READS = 3
DISK_FACTOR = 1.5
"""The first read counts as the disk's where it took at least this many times the best later read."""


def read_seconds(files: list[Path]) -> tuple[float, int]:
    """Seconds to read these files after evicting them from this machine's page cache, and their bytes."""
    evict(files)
    start_t, size = time.perf_counter(), 0
    buf = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                size += n
    return time.perf_counter() - start_t, size


@dataclass
class Floors:
    """The reads of the shards after the guest's eviction (seconds), their bytes, and a reference disk speed."""

    reads: list[float]
    size: int
    disk_gbps: float | None = None

    @property
    def host_cached(self) -> float:
        return min(self.reads[1:])

    @property
    def first_from_disk(self) -> bool:
        return self.reads[0] >= DISK_FACTOR * self.host_cached

    @property
    def disk(self) -> float | None:
        """The first read where it came from the disk, else the size at --disk-gbps, else None (not measured)."""
        if self.first_from_disk:
            return self.reads[0]
        return self.size / (self.disk_gbps * 1e9) if self.disk_gbps else None

    def describe(self) -> str:
        gbps = ", ".join(f"{self.size / r / 1e9:.2f}" for r in self.reads)
        lines = [f"  reads after evicting them from this machine's page cache: "
                 f"{', '.join(f'{r:.2f}' for r in self.reads)} s ({gbps} GB/s)"]
        if self.first_from_disk:
            lines.append(f"  disk floor (1st read: the host's cache did not hold them): {self.reads[0]:.2f} s")
        elif self.disk is not None:
            lines.append(f"  disk floor: {self.disk:.2f} s at --disk-gbps {self.disk_gbps} (the 1st read, "
                         f"{self.reads[0]:.2f} s, came from the host's cache: the disk was not seen in this run)")
        else:
            lines.append(f"  disk floor: not measured (the 1st read, {self.reads[0]:.2f} s, came from the host's "
                         "cache too; --disk-gbps sets one)")
        lines.append(f"  host-cached floor (best later read: the guest's cache cold, the host's warm): "
                     f"{self.host_cached:.2f} s ({self.size / self.host_cached / 1e9:.2f} GB/s)")
        return "\n".join(lines)

    def ratios(self, seconds: float) -> str:
        disk = f"{seconds / self.disk:.1f}x the disk floor, " if self.disk else ""
        return f"{disk}{seconds / self.host_cached:.1f}x the host-cached floor"


def measure_floors(files: list[Path], disk_gbps: float | None) -> Floors:
    reads, size = [], 0
    for _ in range(READS):
        seconds, size = read_seconds(files)
        reads.append(seconds)
    return Floors(reads, size, disk_gbps)


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
    parser.add_argument("--disk-gbps", type=float, default=None, help="the disk's read speed (GB/s) for the disk "
                        "floor where the run does not see the disk (the host's cache held the files)")
    args = parser.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, threads {torch.get_num_threads()}")
    for dtype in args.dtypes.split(","):
        model_dir = make_sharded_model(root / f"qwen2-0.5b-{dtype}", QWEN2_05B, dtype)
        files = weight_files(model_dir)
        floors = measure_floors(files, args.disk_gbps)
        print(f"\n{dtype}: {len(files)} shards, {floors.size / 1e9:.2f} GB\n{floors.describe()}", flush=True)
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
                    print(f"  {kind}{label}: first token {seconds:.2f} s ({floors.ratios(seconds)})\n"
                          f"      executor: {phases}\n      scheduler: {waits}", flush=True)
        summary = {k: round(min(v), 2) for k, v in results.items()}
        disk = f"disk floor {floors.disk:.2f} s, " if floors.disk else "disk floor not measured, "
        print(f"  best: {json.dumps(summary)}; {disk}host-cached floor {floors.host_cached:.2f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
