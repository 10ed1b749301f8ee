"""Structured outputs (#30): decode throughput and inter-token latency with and without a JSON-schema constraint.

    python -m benchmarks.structured [--batches 1,64] [--max-tokens 48] [--models default,151k] [--dir DIR]

For each model (the embedded default model, vocabulary 2,048; and `151k`: a random-weight Llama with the default
model's shape but a vocabulary of 151,936, whose tokenizer is the default one widened with random byte-level words
to 151,936 tokens, made once under --dir) a torch executor and a scheduler are started on loopback, then for each
batch size B, B concurrent gRPC streams generate max_tokens tokens each:

- unconstrained: ignore_eos (so every stream produces exactly max_tokens tokens, through the sampler's greedy fast
  path);
- constrained: response JSON schema {"text": string of at least 4096 characters}, so the grammar never completes
  within max_tokens and every stream produces max_tokens tokens through the mask.

Free and constrained runs alternate --repeats times (the medians are compared: the machine may be shared). Prints
tokens/s and the ITL (mean and p50 of every gap between a stream's responses), and the constrained/free ratio
measured in the same run: the cost of the mask fill (xgrammar, in the engine core), its transport, the wait for masks
that follow their step (async scheduling) and their application in the executor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from client.lib import PagedServeClient
from executor_service.default_model.model import (
    ModelSpec,
    build_config,
    ensure_default_model,
    weight_shapes,
    write_json,
)
from protos.pagedserve.v1 import common_pb2
from tests.support.procs import running_stack

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}}, "required": ["text"]}
WIDE_VOCAB = 151936


def widened_tokenizer(vocab_size: int) -> dict[str, object]:
    """The default model's tokenizer.json with random byte-level words appended up to vocab_size tokens."""
    spec = json.loads((ensure_default_model() / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    while len(vocab) < vocab_size:
        word = ("Ġ" if rng.random() < 0.5 else "") + "".join(rng.choice(letters) for _ in range(rng.randint(2, 9)))
        vocab.setdefault(word, len(vocab))
    return spec


def make_wide_model(out_dir: Path) -> Path:
    """A random-weight model of the default shape with a 151,936-token vocabulary (made once)."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = ModelSpec(vocab_size=WIDE_VOCAB, tie_word_embeddings=True, max_position_embeddings=1024)
    gen = torch.Generator().manual_seed(0)
    weights = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02)
               for name, shape in weight_shapes(spec)}
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    write_json(out_dir / "config.json", build_config(spec))
    default = ensure_default_model()
    for name in ("generation_config.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out_dir / name).write_text((default / name).read_text())
    (out_dir / "tokenizer.json").write_text(json.dumps(widened_tokenizer(WIDE_VOCAB)))
    return out_dir


async def one_stream(address: str, i: int, max_tokens: int, constrained: bool) -> tuple[int, list[float]]:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0, "seed": i}
    if constrained:
        kwargs["structured_outputs"] = common_pb2.StructuredOutputs(json=json.dumps(SCHEMA))
    else:
        kwargs["ignore_eos"] = True
    gaps: list[float] = []
    tokens = 0
    last = None
    async with PagedServeClient(address) as client:
        async for r in client.generate(prompt=f"Item {i}: a long description", **kwargs):
            now = time.perf_counter()
            if last is not None and r.token_ids:
                gaps.append((now - last) / len(r.token_ids))
            if r.token_ids:
                last = now
            tokens += len(r.token_ids)
    return tokens, gaps


async def measure(address: str, batch: int, max_tokens: int, constrained: bool) -> tuple[float, float, float]:
    await asyncio.gather(*(one_stream(address, i, 4, constrained) for i in range(min(batch, 4))))  # warm-up
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(address, i, max_tokens, constrained) for i in range(batch)))
    wall = time.perf_counter() - t0
    tokens = sum(t for t, _ in results)
    gaps = [g for _, gs in results for g in gs]
    return tokens / wall, statistics.mean(gaps) * 1e3, statistics.median(gaps) * 1e3


def medians(runs: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    tokens, mean, p50 = (statistics.median(r[k] for r in runs) for k in range(3))
    return tokens, mean, p50


def run_model(name: str, executor_args: list[str], batches: list[int], max_tokens: int, tmp: Path,
              scheduler_args: list[str], repeats: int) -> None:
    """Free and constrained runs alternate `repeats` times; the medians are compared (the machine may be shared)."""
    tmp.mkdir(parents=True, exist_ok=True)
    with running_stack(tmp, ["--device", "cpu", *executor_args], scheduler_args) as stack:
        for batch in batches:
            runs: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
            for _ in range(repeats):
                for constrained in (False, True):
                    runs[constrained].append(asyncio.run(measure(stack.address, batch, max_tokens, constrained)))
            free, held = (medians(runs[c]) for c in (False, True))
            print(f"{name} batch {batch:3d} (median of {repeats}): free {free[0]:8.1f} tok/s ITL mean "
                  f"{free[1]:7.2f} ms p50 {free[2]:7.2f} | json-schema {held[0]:8.1f} tok/s ITL mean {held[1]:7.2f} ms "
                  f"p50 {held[2]:7.2f}"
                  f" | ITL ratio {held[1] / free[1]:.3f} (p50 {held[2] / free[2]:.3f}), throughput ratio "
                  f"{held[0] / free[0]:.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--models", default="default,151k")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/pagedserve-structured-bench"))
    parser.add_argument("--repeats", type=int, default=3, help="alternating free/constrained runs per batch size")
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags, e.g. --no-async-scheduling")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for name in args.models.split(","):
        extra = [] if name == "default" else ["--model", str(make_wide_model(args.dir / "wide-151k"))]
        run_model(name, [*extra, "--num-gpu-blocks", "1024"], batches, args.max_tokens, args.dir / f"logs-{name}",
                  args.scheduler_args.split(), args.repeats)


if __name__ == "__main__":
    main()
