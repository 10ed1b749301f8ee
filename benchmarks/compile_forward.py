"""torch.compile (inductor) of the whole model step against eager, per bucketed batch size, in thread CPU time.

    python -m benchmarks.compile_forward [--model DIR] [--variants default,freezing] [--repeats 5]
        [--greedy-steps 32] [--json-out FILE]

The model step is the model forward plus the LM head (no batch building, no sampler), as TorchBackend runs it.
Steps: decode at batch 1, 16 and 64 (contexts 48 - 200 tokens) and a prefill of 8 x 64 prompt tokens. Each
compiled variant is `torch.compile(step, backend="inductor", dynamic=False, fullgraph=True)` with inductor
options (--variants: default; freezing = weight constant-folding and prepacking; cpp_wrapper = the graph's
wrapper in C++; both), one compiled graph per bucket: the batch is padded up to the bucket's token, sequence and
sample counts (padded tokens write no KV: slot -1; padded sequences have 0 query tokens and 0 context, so the
attention skips them; block tables padded to the model's full width), so that a step's contexts never cause
a recompile. The paged-attention and KV-write ops are opaque to dynamo: Python custom ops (torch.library) with
fake implementations that call the executor's own attention functions (the C++ CPU kernel).

Reported: compile seconds per bucket (wall and process CPU, under whatever load the machine has), the best of
--repeats thread-CPU timings of eager and compiled, interleaved round by round (two rounds of --repeats),
and whether --greedy-steps greedy decode steps of 12 sequences (padded to the 16 bucket) give the same tokens
compiled as eager and as transformers' generate. One thread (torch.set_num_threads(1); inductor then emits no
OpenMP). Set TORCHINDUCTOR_CACHE_DIR so reruns reuse compiled kernels (cache hits shorten compile times).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from executor_service.backend import BatchItem, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model import ensure_random_model
from executor_service.model import AttentionMetadata, AttentionOps, llama
from executor_service.torch_backend import Batch, TorchBackend

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

@dataclass(slots=True)
class StepContext:
    """What the attention op of a compiled step reads besides q, k, v (as vLLM's forward context): the step's
    real (unpadded) metadata and token count, the KV cache layers and the executor's attention functions."""

    ops: AttentionOps
    kv_caches: list[tuple[Tensor, Tensor]]
    meta: AttentionMetadata | None = None
    num_tokens: int = 0


_CONTEXTS: dict[int, StepContext] = {}  # handle -> context; the op's int argument names it


@torch.library.custom_op("pagedserve_compile::attention", mutates_args=())
def attention_op(query: Tensor, key: Tensor, value: Tensor, layer: int, scale: float, handle: int) -> Tensor:
    """Write this step's K/V into the layer's cache and attend (the cache is not a graph input: the compiled
    graph neither copies nor guards it). Rows past the step's real tokens are padding: written nowhere,
    attended by nothing, left unset in the output."""
    ctx = _CONTEXTS[handle]
    meta, n = ctx.meta, ctx.num_tokens
    if meta is None:
        raise RuntimeError("pagedserve_compile::attention called outside a compiled step")
    k_cache, v_cache = ctx.kv_caches[layer]
    ctx.ops.write_kv(key[:n], value[:n], k_cache, v_cache, meta.slot_mapping)
    return ctx.ops.paged_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale)


def register_packed_linear_fake() -> None:
    """The executor's packed linear (model/packed.py) as an opaque op too: its output is x @ weight^T + bias."""
    if not hasattr(torch.ops.pagedserve_linear, "linear"):
        return

    @torch.library.register_fake("pagedserve_linear::linear")
    def _(x: Tensor, packed: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty((x.shape[0], weight.shape[0]))


@attention_op.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, layer: int, scale: float, handle: int) -> Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """llama.apply_rope's products and sums without its `out=` views, which dynamo cannot trace."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def route_attention(attn: llama.Attention, layer: int, handle: int) -> None:
    """When compiling, this layer's attention goes through the opaque op; eager calls are unchanged."""
    eager_forward = attn.forward

    def forward(x: Tensor, cos: Tensor, sin: Tensor, kv_cache: tuple[Tensor, Tensor],
                meta: AttentionMetadata) -> Tensor:
        if not torch.compiler.is_compiling():
            return eager_forward(x, cos, sin, kv_cache, meta)
        num_tokens = x.shape[0]
        qkv = attn.qkv_proj(x)
        qk_size = attn.q_size + attn.kv_size
        qk = apply_rope(qkv[:, :qk_size].view(num_tokens, attn.num_heads + attn.num_kv_heads, attn.head_dim),
                              cos, sin)
        q, k = qk[:, : attn.num_heads], qk[:, attn.num_heads :]
        v = qkv[:, qk_size:].view(num_tokens, attn.num_kv_heads, attn.head_dim)
        out = torch.ops.pagedserve_compile.attention(q, k, v, layer, attn.scale, handle)
        return attn.o_proj(out.reshape(num_tokens, attn.q_size))

    attn.forward = forward  # type: ignore[method-assign]


@dataclass(slots=True, frozen=True)
class Bucket:
    tokens: int
    seqs: int
    samples: int

    def fits(self, batch: Batch) -> bool:
        return (batch.input_ids.shape[0] <= self.tokens and batch.meta.seq_lens.shape[0] <= self.seqs
                and batch.output_rows.shape[0] <= self.samples)


def pad(t: Tensor, size: int, value: int) -> Tensor:
    if t.shape[0] == size:
        return t
    out = torch.full((size, *t.shape[1:]), value, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


class CompiledSteps:
    """The backend's model step compiled once per bucket (lazily); batches no bucket fits run eagerly."""

    def __init__(self, backend: TorchBackend, buckets: list[Bucket], options: dict[str, Any]) -> None:
        self.backend = backend
        self.buckets = sorted(buckets, key=lambda b: (b.tokens, b.seqs, b.samples))
        self.compile_seconds: dict[Bucket, tuple[float, float]] = {}
        model = backend.model
        layers = model.model.layers
        self.context = StepContext(layers[0].self_attn.ops, backend.kv_cache.layers)
        handle = len(_CONTEXTS)
        _CONTEXTS[handle] = self.context
        for i, layer in enumerate(layers):
            route_attention(layer.self_attn, i, handle)
        no_caches = [(torch.empty(0), torch.empty(0))] * len(layers)
        torch._dynamo.config.cache_size_limit = max(8, len(buckets))

        def step(input_ids: Tensor, positions: Tensor, output_rows: Tensor) -> Tensor:
            return model.compute_logits(model(input_ids, positions, None, no_caches, output_rows))  # type: ignore[arg-type]

        self.compiled = torch.compile(step, backend="inductor", dynamic=False, fullgraph=True, options=options)

    def bucket_for(self, batch: Batch) -> Bucket | None:
        return next((b for b in self.buckets if b.fits(batch)), None)

    def run(self, batch: Batch) -> Tensor:
        """Logits of the batch's sampled rows."""
        bucket = self.bucket_for(batch)
        if bucket is None:
            return eager_logits(self.backend, batch)
        args = (pad(batch.input_ids, bucket.tokens, 0), pad(batch.positions, bucket.tokens, 0),
                pad(batch.output_rows, bucket.samples, 0))
        self.context.meta, self.context.num_tokens = batch.meta, batch.input_ids.shape[0]
        try:
            with torch.inference_mode():
                if bucket not in self.compile_seconds:
                    self.compile_seconds[bucket] = self.compile(args)
                return self.compiled(*args)[: batch.output_rows.shape[0]]
        finally:
            self.context.meta = None

    def compile(self, args: tuple[Tensor, ...]) -> tuple[float, float]:
        """Compile (the first call of a bucket): wall seconds, and CPU seconds of this process and its children."""
        wall, cpu = time.perf_counter(), cpu_seconds()
        self.compiled(*args)
        return time.perf_counter() - wall, cpu_seconds() - cpu


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def eager_logits(backend: TorchBackend, batch: Batch) -> Tensor:
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


def measure(eager: TorchBackend, compiled: CompiledSteps, items: list[BatchItem], repeats: int,
            rounds: int) -> dict[str, Any]:
    fill_context(eager, items)
    fill_context(compiled.backend, items)
    batch_e, batch_c = eager.prepare(items), compiled.backend.prepare(items)
    same = torch.equal(eager_logits(eager, batch_e).argmax(-1), compiled.run(batch_c).argmax(-1))
    bucket = compiled.bucket_for(batch_c)
    wall, cpu = compiled.compile_seconds.get(bucket, (0.0, 0.0)) if bucket else (0.0, 0.0)
    eager_ms, compiled_ms = [], []
    for _ in range(rounds):
        eager_ms.append(timed(lambda: eager_logits(eager, batch_e), repeats) * 1e3)
        compiled_ms.append(timed(lambda: compiled.run(batch_c), repeats) * 1e3)
    return {"compile_wall_s": round(wall, 1), "compile_cpu_s": round(cpu, 1),
            "eager_ms": [round(x, 2) for x in eager_ms], "compiled_ms": [round(x, 2) for x in compiled_ms],
            "speedup": [round(e / c, 3) for e, c in zip(eager_ms, compiled_ms, strict=True)],
            "same_argmax": same}


def greedy_tokens(backend: TorchBackend, run: Callable[[Batch], Tensor], prompts: list[list[int]],
                  steps: int) -> list[list[int]]:
    """Eager prefill of every prompt, then `steps` greedy decode steps of the whole batch through `run`."""
    blocks_each = -(-(max(map(len, prompts)) + steps) // backend.info.block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    first = backend.execute([BatchItem(str(i), s, len(s), 0, len(s), t, True, GREEDY)
                             for i, (s, t) in enumerate(zip(seqs, tables, strict=True))])
    for s, out in zip(seqs, first, strict=True):
        s.append(out.token_id)  # type: ignore[union-attr]
    for _ in range(steps - 1):
        items = [BatchItem(str(i), s, len(p), len(s) - 1, 1, t, True, GREEDY)
                 for i, (s, p, t) in enumerate(zip(seqs, prompts, tables, strict=True))]
        batch = backend.prepare(items)
        for s, token in zip(seqs, run(batch).argmax(-1).tolist(), strict=True):
            s.append(token)
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


def greedy_check(model_dir: Path, eager: TorchBackend, compiled: CompiledSteps, steps: int) -> dict[str, Any]:
    rng = random.Random(1)
    vocab = eager.info.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(48, 200))] for _ in range(12)]
    ours_eager = greedy_tokens(eager, lambda b: eager_logits(eager, b), prompts, steps)
    ours_compiled = greedy_tokens(compiled.backend, compiled.run, prompts, steps)
    hf = hf_greedy(model_dir, prompts, steps)
    return {"greedy_steps": steps, "sequences": len(prompts), "compiled_equals_eager": ours_compiled == ours_eager,
            "eager_equals_transformers": None if hf is None else ours_eager == hf,
            "compiled_equals_transformers": None if hf is None else ours_compiled == hf}


def make_backend(model_dir: Path, prepack: bool = True) -> TorchBackend:
    return TorchBackend.create(ExecutorConfig(model=str(model_dir), device="cpu", num_gpu_blocks=NUM_BLOCKS,
                                              cpu_weight_prepack=prepack))


def buckets_of(items_by_shape: list[tuple[str, list[BatchItem]]]) -> list[Bucket]:
    out = []
    for _, items in items_by_shape:
        tokens = sum(i.num_tokens for i in items)
        out.append(Bucket(tokens, len(items), len(items)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the random default model)")
    p.add_argument("--variants", default="default,freezing", help=f"comma-separated, of {', '.join(OPTIONS)}, each optionally with {UNPACKED}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--greedy-steps", type=int, default=32)
    p.add_argument("--skip", default="", help="comma-separated step names' first words to skip (decode, prefill)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._inductor.config.compile_threads = 1
    model_dir = args.model or ensure_random_model()
    eager = make_backend(model_dir)
    register_packed_linear_fake()
    blocks_each = NUM_BLOCKS // max(DECODE_SIZES)
    steps = [(name, items) for name, items in shapes(eager.info.vocab_size, blocks_each)
             if name.split()[0] not in args.skip.split(",")]
    print(json.dumps({"model": str(model_dir), "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
                      "torch": torch.__version__}), flush=True)
    rows = []
    for variant in args.variants.split(","):
        torch._dynamo.reset()  # each variant's compiled graphs from scratch (the in-memory caches only)
        options = OPTIONS[variant.removesuffix(UNPACKED)]
        compiled = CompiledSteps(make_backend(model_dir, not variant.endswith(UNPACKED)), buckets_of(steps), options)
        for name, items in steps:
            row = {"variant": variant, "step": name} | measure(eager, compiled, items, args.repeats, args.rounds)
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.greedy_steps:
            row = {"variant": variant} | greedy_check(model_dir, eager, compiled, args.greedy_steps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"bench": "compile_forward", "rows": rows, "max_rss_mb": usage.ru_maxrss // 1024}
    if args.json_out:
        with open(args.json_out, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
