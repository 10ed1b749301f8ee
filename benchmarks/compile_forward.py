"""torch.compile (inductor) of the whole model step against eager, per bucketed batch size, in thread CPU time.

    python -m benchmarks.compile_forward [--model DIR] [--variants default,freezing] [--repeats 5]
        [--greedy-steps 32] [--json-out FILE]

The model step is TorchBackend.forward plus the LM head (no batch building, no sampler) on a default backend
(eager) and on one with executor_service.runner.compiled.CompiledForward (--compile-sizes) for the steps' token counts.
Steps: decode at batch 1, 16 and 64 (contexts 48 - 200 tokens) and a prefill of 8 x 64 prompt tokens. Each
variant compiles with `torch.compile(..., backend="inductor", dynamic=False, fullgraph=True)` and inductor
options (--variants: default; freezing = weights constant-folded and prepacked by inductor; cpp_wrapper = the
graph's wrapper in C++; both; a "-unpacked" suffix: the compiled backend without the executor's own packed MKL
weights, --no-cpu-weight-prepack). One graph per token count; attention is an opaque custom op
(executor_service/runner/compiled.py).

Reported per step: the compile size, its compile time (wall, and CPU of this process and the compiler's
children; under whatever load the machine has, and shorter when TORCHINDUCTOR_CACHE_DIR already holds its
kernels), the best of --repeats thread-CPU timings of eager and compiled, interleaved, in --rounds rounds, and
whether the step's greedy tokens agree; then whether --greedy-steps greedy tokens of 12 sequences (decodes padded
to the 16 size) are the same compiled, eager and from transformers' generate. One thread
(torch.set_num_threads(1); inductor then emits no OpenMP).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import ensure_random_model
from executor_service.runner.compiled import CompiledForward
from executor_service.runner.torch_backend import Batch, TorchBackend

GREEDY = SamplingConfig(temperature=0.0)
NUM_BLOCKS = 2048
DECODE_SIZES = (1, 16, 64)
PREFILL = (8, 64)
OPTIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "freezing": {"freezing": True},
    "cpp_wrapper": {"cpp_wrapper": True},
    "freezing+cpp_wrapper": {"freezing": True, "cpp_wrapper": True},
}
UNPACKED = "-unpacked"  # variant suffix: the compiled backend without the executor's MKL-packed linear weights


def step_logits(backend: TorchBackend, batch: Batch) -> Tensor:
    """The model step as the executor runs it (compiled where backend.compiled has a size for it) + LM head."""
    with torch.inference_mode():
        return backend.model.compute_logits(backend.forward(batch))


def step_items(kind: str, n: int, lengths: list[int], vocab: int, blocks_each: int) -> list[BatchItem]:
    rng = random.Random(n * 1000 + sum(lengths))
    items = []
    for i, length in enumerate(lengths):
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        table = list(range(i * blocks_each, (i + 1) * blocks_each))
        start = 0 if kind == "prefill" else length - 1
        items.append(BatchItem(str(i), tokens, length, start, length - start, table, True, GREEDY))
    return items


def shapes(vocab: int, blocks_each: int) -> list[tuple[str, list[BatchItem]]]:
    rng = random.Random(0)
    out = []
    for n in DECODE_SIZES:
        out.append((f"decode {n} x ctx 48-200", step_items("decode", n, [rng.randint(48, 200) for _ in range(n)],
                                                            vocab, blocks_each)))
    seqs, length = PREFILL
    out.append((f"prefill {seqs} x {length}", step_items("prefill", seqs, [length] * seqs, vocab, blocks_each)))
    return out


def fill_context(backend: TorchBackend, items: list[BatchItem]) -> None:
    backend.execute([BatchItem(i.request_id, i.token_ids, len(i.token_ids), 0, len(i.token_ids), i.block_table,
                               False, GREEDY) for i in items])


def timed(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def measure(eager: TorchBackend, compiled: TorchBackend, items: list[BatchItem], repeats: int,
            rounds: int) -> dict[str, Any]:
    """Compile (the first compiled step of its size), then eager and compiled timings, interleaved round by round."""
    if compiled.compiled is None:
        raise ValueError("the compiled backend needs its CompiledForward")
    fill_context(eager, items)
    graphs, compiled.compiled = compiled.compiled, None
    fill_context(compiled, items)  # eagerly, so that each size compiles in its own step below
    compiled.compiled = graphs
    batch_e, batch_c = eager.prepare(items), compiled.prepare(items)
    size = graphs.bucket(batch_c.input_ids.shape[0])
    logits_e = step_logits(eager, batch_e)
    cpu = cpu_seconds()
    logits_c = step_logits(compiled, batch_c)
    cpu = cpu_seconds() - cpu
    same = torch.equal(logits_e.argmax(-1), logits_c.argmax(-1))
    eager_ms, compiled_ms = [], []
    for _ in range(rounds):
        eager_ms.append(timed(lambda: step_logits(eager, batch_e), repeats) * 1e3)
        compiled_ms.append(timed(lambda: step_logits(compiled, batch_c), repeats) * 1e3)
    return {"size": size, "compile_wall_s": round(graphs.compile_seconds.get(size or 0, 0.0), 1),
            "compile_cpu_s": round(cpu, 1), "eager_ms": [round(x, 2) for x in eager_ms],
            "compiled_ms": [round(x, 2) for x in compiled_ms],
            "speedup": [round(e / c, 3) for e, c in zip(eager_ms, compiled_ms, strict=True)], "same_argmax": same}


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the compiler's)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def greedy_tokens(backend: TorchBackend, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill of every prompt, then `steps` - 1 greedy decode steps of the whole batch, through execute()."""
    blocks_each = -(-(max(map(len, prompts)) + steps) // backend.info.block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        items = [BatchItem(str(i), s, len(p), 0 if len(s) == len(p) else len(s) - 1,
                           len(s) if len(s) == len(p) else 1, t, True, GREEDY)
                 for i, (s, p, t) in enumerate(zip(seqs, prompts, tables, strict=True))]
        for s, out in zip(seqs, backend.execute(items), strict=True):
            s.append(out.token_id)  # type: ignore[union-attr]
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def hf_greedy(model_dir: Path, prompts: list[list[int]], steps: int) -> list[list[int]] | None:
    try:
        import transformers
    except ImportError:
        return None
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                              pad_token_id=0)
            out.append(gen[0, len(prompt):].tolist())
    return out


def greedy_check(model_dir: Path, eager: TorchBackend, compiled: TorchBackend, steps: int) -> dict[str, Any]:
    """12 sequences (decodes padded to the 16 size), `steps` greedy tokens each: compiled, eager, transformers."""
    rng = random.Random(1)
    vocab = eager.info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(48, 200))] for _ in range(12)]
    ours_eager = greedy_tokens(eager, prompts, steps)
    ours_compiled = greedy_tokens(compiled, prompts, steps)
    hf = hf_greedy(model_dir, prompts, steps)
    return {"greedy_steps": steps, "sequences": len(prompts), "compiled_equals_eager": ours_compiled == ours_eager,
            "eager_equals_transformers": None if hf is None else ours_eager == hf,
            "compiled_equals_transformers": None if hf is None else ours_compiled == hf}


def make_backend(model_dir: Path, prepack: bool = True) -> TorchBackend:
    backend = TorchBackend.create(ExecutorConfig(model=str(model_dir), device="cpu", num_gpu_blocks=NUM_BLOCKS,
                                                 cpu_weight_prepack=prepack))
    backend.wait_for_packing()  # the packing (and a cold start's measurement) after ready: done before timing
    return backend


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the random default model)")
    p.add_argument("--variants", default="default,freezing",
                   help=f"comma-separated, of {', '.join(OPTIONS)}, each optionally with {UNPACKED}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--greedy-steps", type=int, default=32)
    p.add_argument("--skip", default="", help="comma-separated step kinds to skip (decode, prefill)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    model_dir = args.model or ensure_random_model()
    eager = make_backend(model_dir)
    blocks_each = NUM_BLOCKS // max(DECODE_SIZES)
    steps = [(name, items) for name, items in shapes(eager.info.vocab_size, blocks_each)
             if name.split()[0] not in args.skip.split(",")]
    sizes = tuple(sorted({sum(i.num_tokens for i in items) for _, items in steps}))
    print(json.dumps({"model": str(model_dir), "sizes": sizes, "torch": torch.__version__,
                      "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}), flush=True)
    rows = []
    for variant in args.variants.split(","):
        torch._dynamo.reset()  # each variant compiles its graphs anew (in memory; the on-disk cache still hits)
        compiled = make_backend(model_dir, not variant.endswith(UNPACKED))
        compiled.compiled = CompiledForward(compiled.model, compiled.kv_cache.layers, sizes,
                                            OPTIONS[variant.removesuffix(UNPACKED)])
        for name, items in steps:
            row = {"variant": variant, "step": name} | measure(eager, compiled, items, args.repeats, args.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.greedy_steps:
            row = {"variant": variant} | greedy_check(model_dir, eager, compiled, args.greedy_steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    record = {"bench": "compile_forward", "rows": rows}
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
