"""The torch executor backend: a Llama-family model over a paged KV cache, on CUDA or the CPU."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from itertools import chain, pairwise
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from executor_service.attention import get_attention_ops
from executor_service.backend import (
    BackendInfo,
    BatchItem,
    SampleOutput,
    SamplingConfig,
)
from executor_service.config import ExecutorConfig
from executor_service.converted import ConvertedWeights
from executor_service.default_model.paths import ensure_default_model  # torch- and tokenizers-free (#33)
from executor_service.model import (
    SINGLE,
    AttentionMetadata,
    LlamaForCausalLM,
    ModelConfig,
    ModelOps,
    ParallelContext,
    cpu_ops,
    load_model,
)
from executor_service.model.calibration import PackWhileReading
from executor_service.model.files import read_tokenizer_files
from executor_service.model.packed import Packing
from executor_service.runner.background_packing import BackgroundPacking
from executor_service.runner.calibration import finished, start_calibration
from executor_service.runner.compiled import CompiledForward
from executor_service.runner.cuda_graphs import DecodeGraphs
from executor_service.runner.draft_model import DraftModel, check_draft_vocabulary
from executor_service.runner.kv_cache import CacheShape, KVCache
from executor_service.runner.kv_groups import KVLayout, plan_layout
from executor_service.runner.prompt_logprobs import (
    PromptRowLogprobs,
    fill_prompt_logprobs,
    prompt_row_logprobs,
    prompt_rows,
    prompt_targets,
    prompt_top_k,
)
from executor_service.runner.sampler import Sampler, SampleRequest, plain_greedy
from executor_service.runner.speculative import accept_runs, expand_drafts, row_index, verify_requests, verify_rows
from executor_service.startup import MeasureCache, Phases, default_cache_dir
from executor_service.token_masks import resolve_masks
from executor_service.validator import MAX_NUM_DRAFT_TOKENS, RequestRefused, check_span
from protos.contract import BlockMap

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PROFILE_SAMPLE_ROWS = 256
WARM_UP_ROWS = 2
INLINE_STEP_S = 0.02
"""A decode step expected to take less than this runs on the event loop's thread: the hop to the forward thread
and back costs 0.1 - 0.2 ms a step, and the loop can wait this long (a swap already runs on it). Only with one
forward thread: libgomp gives each thread that opens a parallel region its own pool, so multi-threaded passes on two
threads mean two pools, more OpenMP threads than cores, and libgomp's throttled waiting (#29)."""

log = logging.getLogger("pagedserve.executor")
T = TypeVar("T")


@dataclass(slots=True)
class Batch:
    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    output_rows: Tensor
    sample_items: list[int]
    decode_only: bool
    prompt_rows: list[int] = field(default_factory=list)
    """Rows whose logprobs give prompt logprobs (runner/prompt_logprobs.py); output_rows ends with them."""
    prompt_targets: list[int] = field(default_factory=list)
    """The prompt token each prompt row predicts."""
    prompt_k: int = 0
    """The most top alternatives an item asks for its prompt positions."""
    prompt_result: PromptRowLogprobs | None = None
    """Set by run_batch: the prompt rows' logprobs (their logits are never returned whole)."""
    every_row: bool = False
    """output_rows is every row in order (a decode step that samples each item): the forward pass keeps them all
    without gathering them."""

    def rows_to_keep(self) -> Tensor | None:
        """output_rows for the model's forward; None where they are every row."""
        return None if self.every_row else self.output_rows


@dataclass(slots=True, frozen=True)
class DecodeTime:
    """How long the last decode step of how many requests took (none yet: unknown, so infinite)."""

    seconds: float = math.inf
    num_items: int = 1

    def expected_s(self, num_items: int) -> float:
        """A step of num_items decodes, scaled linearly from the last one (an upper bound: decode is weight-bound
        at small batches)."""
        return self.seconds * max(1.0, num_items / self.num_items)


class TorchBackend:
    overlaps_token_masks = True  # masks that follow a step are awaited after its forward pass (token_masks.py)

    def __init__(self, *, info: BackendInfo, model: LlamaForCausalLM, kv_cache: KVCache, sampler: Sampler,
                 device: torch.device, graphs: DecodeGraphs | None = None,
                 compiled: CompiledForward | None = None, layout: KVLayout | None = None) -> None:
        self.info = info
        self.layout = layout or KVLayout.single(len(kv_cache.layers))
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = device
        self._forward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.graphs = graphs
        self.compiled = compiled
        self._last_decode = DecodeTime()
        self._on_thread: Future[list[SampleOutput | None]] = done_future()
        self.calibration: Future[Packing] = finished(Packing(None, 0))
        """The background measurement of a cold start's packing choice (runner/background_packing.py, or with
        --no-cpu-pack-after-ready runner/calibration.py); done otherwise."""
        self.packing_after_ready: BackgroundPacking | None = None
        """The packing made after ready, swapped in between passes (runner/background_packing.py)."""
        self.draft: DraftModel | None = None
        """--draft-model: the model that proposes drafts for items with num_model_drafts (runner/draft_model.py)."""

    @classmethod
    def create(cls, config: ExecutorConfig, parallel: ParallelContext = SINGLE,
               converted: ConvertedWeights | None = None) -> TorchBackend:
        """Load the model (config.model, or the embedded default), size and allocate the KV cache.
        Under tensor parallelism every rank calls this together and holds its shard of both. `converted`: the
        checkpoint's bfloat16 tensors widened to float32 while torch imported (prefetch.py), used where they fit."""
        if config.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {config.block_size}")
        phases = Phases()
        phases.seconds["interpreter+imports"] = phases.total_s()  # from the process's start to here
        device = resolve_device(config.device)
        model_dir = Path(config.model) if config.model else ensure_default_model()
        model_cfg = ModelConfig.from_dir(model_dir)
        max_model_len = resolve_max_model_len(config.max_model_len, model_cfg)
        dtype = resolve_dtype(config.dtype, model_cfg.dtype, device)
        with phases.phase("kernels"):  # load (a build only where none is cached: the Docker image prebuilds them)
            ops = model_ops(device, dtype)
        compiles = bool(config.compile_sizes) and device.type == "cpu" and parallel.world_size == 1 \
            and model_cfg.features.graphable
        pipeline = PackWhileReading(config.cpu_gemm, config.cpu_skinny_rows, startup_cache(config, parallel),
                                    defer=config.cpu_pack_after_ready) \
            if config.cpu_weight_prepack and not compiles and parallel.world_size == 1 else None
        model = load_model(model_dir, device=device, dtype=dtype, ops=ops, parallel=parallel, phases=phases,
                           on_file=pipeline, converted=converted)
        packing = Packing(None, 0)
        if config.cpu_weight_prepack and compiles:
            log.info("--compile-sizes: linear weights are left to torch.compile (it cannot lower a packed oneDNN "
                     "linear, and a background measurement would swap packs under its graphs)")
        elif config.cpu_weight_prepack:
            with phases.phase("pack"):  # what the reading left to pack: packed beside it (PackWhileReading)
                packing = choose_packing(config, model, parallel, pipeline)
                model.pack_experts()
        parallel.wait_for_all()
        # every TP rank plans the same groups; the step channel carries a batch's per-layer metadata (its rings)
        layout = plan_layout(model_cfg.layer_windows, config.kv_window_release)
        if layout.window_only and config.draft_model:  # the draft model's full-attention layers read the table
            layout = KVLayout.single(model_cfg.num_layers)
        shape = CacheShape(layout.page_layers, config.block_size, model.layout.num_kv_heads,
                           model_cfg.head_dim, resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device))
        sampler = Sampler(config.seed, device)
        with phases.phase("kv"):
            num_device_blocks = parallel.min_int(
                count_device_blocks(config, model, sampler, shape, device, layout.layer_slots), device)
            num_swap_blocks = count_swap_blocks(config, shape)
            kv_cache = KVCache(shape, num_device_blocks=num_device_blocks, num_swap_blocks=num_swap_blocks,
                               device=device, layer_slots=layout.layer_slots, huge_pages=config.cpu_huge_pages)
            log.info("KV cache in %s: %d device and %d swap blocks of %d bytes",
                     str(shape.dtype).removeprefix("torch."), num_device_blocks, num_swap_blocks, shape.bytes_per_block)
        with phases.phase("tokenizer"):
            info = build_info(config, model_dir, model_cfg, dtype, device, max_model_len, num_device_blocks,
                              num_swap_blocks)
            info = replace(info, kv_window_groups=layout.num_window_groups, kv_window=layout.window,
                           kv_window_ring=layout.num_window_groups > 0, kv_window_only=layout.window_only)
        sampler.eos_token_ids = info.eos_token_ids  # masked, with stop_token_ids, until min_tokens are out
        graphs = None
        graphable = model_cfg.features.graphable
        if (config.cuda_graph_sizes or config.compile_sizes) and not graphable:
            log.warning("%s: CUDA graphs and --compile-sizes are off (sliding windows, soft-capping, sinks, q/k norms"
                        " or experts are not captured yet)", model_cfg.architecture)
        if config.cuda_graph_sizes and device.type == "cuda" and parallel.world_size == 1 and graphable:
            with phases.phase("cuda graphs"):
                graphs = DecodeGraphs(model, kv_cache.layers, config.cuda_graph_sizes,
                                      -(-max_model_len // config.block_size), device)
        compiled = None
        if compiles:
            compiled = CompiledForward(model, kv_cache.layers, config.compile_sizes)
        backend = cls(info=info, model=model, kv_cache=kv_cache, sampler=sampler, device=device, graphs=graphs,
                      compiled=compiled, layout=layout)
        with phases.phase("warm-up"):  # on the forward thread: its OpenMP pool is the one the passes use
            backend._forward_thread.submit(backend.warm_up).result()
        drafts = MAX_NUM_DRAFT_TOKENS if parallel.world_size == 1 else 0  # the TP step channel carries none
        if layout.num_window_groups:  # a rejected draft's ring write must not overwrite a key still in the window
            drafts = min(drafts, config.block_size)
        if config.draft_model:
            with phases.phase("draft model"):
                backend.draft = load_draft_model(config, model_dir, model_cfg, backend, kv_cache, ops, parallel,
                                                 dtype)
        backend.info = replace(info, startup_phases=tuple(phases.seconds.items()), max_num_draft_tokens=drafts,
                               max_num_model_draft_tokens=drafts if backend.draft is not None else 0)
        if packing.deferred:
            background = BackgroundPacking(model.packable_linears(), packing, config.cpu_gemm, config.cpu_skinny_rows,
                                           startup_cache(config, parallel))
            backend.packing_after_ready = background.start()
            weakref.finalize(backend, background.stop)  # a backend dropped unclosed (in process) ends it too
            if packing.provisional:
                backend.calibration = background.done
        elif packing.provisional:
            backend.calibration = start_calibration(model, config.cpu_gemm, config.cpu_skinny_rows,
                                                    startup_cache(config, parallel))
        return backend

    def warm_up(self) -> None:
        """warm_up_steps, so that the kernels' first-call costs (oneDNN's JIT, Triton's compiles, first page faults
        of the weights and the activations) are not the first request's; the sampler's generator is not drawn
        from."""
        for items in warm_up_steps(self.layout.num_window_groups, self.device):
            self.execute(items)
        self._last_decode = DecodeTime()

    def install_packs(self, rows: int = 0) -> None:
        """Swap in the linears packed after ready since the last pass (before a pass, never within one); before a
        pass of `rows` rows that the packed GEMM would serve, pack what is left first (on this thread too)."""
        background = self.packing_after_ready
        if background is None:
            return
        if background.needs_packs(rows):
            background.finish_first_packs()
        if background.install():
            self.packing_after_ready = None

    def wait_for_packing(self, timeout: float | None = None) -> None:
        """Wait for the packing after ready (and a first start's measurement) and swap it all in: for tests and
        benchmarks that time or compare passes, called while no pass runs."""
        for work in self.background_work():
            work.result(timeout)
        if self.packing_after_ready is not None:
            self.install_packs()

    def background_work(self) -> list[Future[Packing]]:
        """What runs on threads after ready: a first start's measurement, and the packing after ready."""
        return [self.calibration, *([self.packing_after_ready.done] if self.packing_after_ready is not None else [])]

    def populate_kv_cache(self, pause: Callable[[], object]) -> int:
        """Fault in the CPU KV caches' pages (the model's and a draft model's), pause() before each chunk
        (kv_cache.populate), once the packing after ready and a first start's measurement are done (the zeroing
        would skew what the start-up cache keeps): bytes done."""
        for work in self.background_work():
            work.result()
        caches = [self.kv_cache, *([self.draft.kv_cache] if self.draft is not None else [])]
        return sum(cache.populate(pause) for cache in caches)

    def on_forward_thread(self, fn: Callable[[], T]) -> T:
        """fn() on the forward thread, where passes run, with that thread's OpenMP team: for benchmarks that time
        passes in process. libgomp keeps one team per thread that opens a parallel region; a second one (passes
        timed on the caller's thread beside the forward thread's warm-up team) puts it past one thread per core,
        where it stops polling and every region's workers sleep and wake: a 2-thread decode step of 5 rows ran no
        faster than 1 thread that way (BENCHMARKS.md section 17, eighteenth session). Not from the forward thread
        itself (fn would wait behind the call)."""
        return self._forward_thread.submit(fn).result()

    def close(self) -> None:
        """End the forward thread (after a pass under way) and a packing after ready still running: for in-process
        users that make backends and drop them (tests, benchmarks); the executor's process ends them by exiting.
        Not the measurement of --no-cpu-pack-after-ready (runner/calibration.py: one call, it runs to its end)."""
        self._forward_thread.shutdown(wait=True)
        if self.packing_after_ready is not None:
            self.packing_after_ready.stop()

    def swap_out(self, mapping: BlockMap) -> None:
        self.kv_cache.swap_out(mapping)
        if self.draft is not None:
            self.draft.swap_out(mapping)

    def swap_in(self, mapping: BlockMap) -> None:
        self.kv_cache.swap_in(mapping)
        if self.draft is not None:
            self.draft.swap_in(mapping)

    def copy(self, mapping: BlockMap) -> None:
        self.kv_cache.copy(mapping)
        if self.draft is not None:
            self.draft.copy(mapping)

    async def execute_async(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        """On the forward thread, so that the event loop serves on during the pass; inline where the pass is a
        decode step that the last one says is short and no pass is still running there (a cancelled step's)."""
        if self._runs_inline(items):
            return self.execute(items)
        self._on_thread = self._forward_thread.submit(self.execute, items)
        return await asyncio.wrap_future(self._on_thread)

    def _runs_inline(self, items: list[BatchItem]) -> bool:
        """A decode step (its items may carry n-gram drafts: a verification at a small batch costs about a decode,
        and the thread hop is a share of it) expected to be short, counting every draft as a decode row."""
        rows = len(items) + sum(len(item.draft_token_ids) for item in items)
        return (torch.get_num_threads() == 1 and self._last_decode.expected_s(rows) < INLINE_STEP_S
                and self._on_thread.done()
                and all(item.num_tokens == 1 and not item.num_model_drafts and item.deferred_masks is None
                        for item in items))

    def execute(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        """Run one forward pass over all items; one entry per item, None where item.sample is False."""
        if not items:
            return []
        if any(item.draft_token_ids or item.num_model_drafts for item in items):
            return self.verify(items)
        t0 = time.perf_counter()
        batch = self.prepare(items)
        with torch.inference_mode():  # once a step: entering it costs ~10 us with the caches cold from the pass
            results = self.sample(items, batch, self.run_batch(batch))
        if batch.decode_only:
            self._last_decode = DecodeTime(time.perf_counter() - t0, len(items))
        return results

    def verify(self, items: list[BatchItem]) -> list[SampleOutput | None]:
        """One forward pass that also computes the items' draft tokens and verifies them (runner/speculative.py):
        each sampled item's run of accepted drafts and the model's token after them. Items with num_model_drafts
        get theirs from the draft model first."""
        if self.draft is not None:
            for item in items:
                validate_item(item, self.info)
            with torch.inference_mode():
                items = self.draft.propose(items)
        batch = self.prepare(expand_drafts(items))
        rows = verify_rows(items, batch.sample_items)
        batch.output_rows = row_index(rows + batch.prompt_rows, self.device)
        batch.every_row = False
        with torch.inference_mode():
            logits = self.run_batch(batch)
            if batch.prompt_result is not None:
                fill_prompt_logprobs(batch.prompt_result, items)
            samples = []
            if logits is not None:
                resolve_masks(items)  # (constrained items of the step, which carry no drafts)
                samples = self.sampler.sample(logits, verify_requests(items, batch.sample_items)) if rows else []
        return accept_runs(items, batch.sample_items, samples)

    def prepare(self, items: list[BatchItem]) -> Batch:
        """Check the items and pack them into device tensors; raises ValueError before any work."""
        for item in items:
            validate_item(item, self.info)
        batch = build_batch(items, self.info, self.device)
        if self.layout.num_window_groups:
            batch.meta.layer_metas = window_group_metas(items, batch.meta, self.layout, self.info, self.device)
        if any(item.sampling.prompt_logprobs is not None for item in items):
            batch.prompt_rows = prompt_rows(items)
            if batch.prompt_rows:
                extra = torch.tensor(batch.prompt_rows, dtype=torch.long, device=self.device)
                batch.output_rows = torch.cat([batch.output_rows, extra])
                batch.every_row = False
                batch.prompt_targets = prompt_targets(items)
                batch.prompt_k = prompt_top_k(items, self.info.vocab_size)
        return batch

    def run_batch(self, batch: Batch) -> Tensor | None:
        """The forward pass and the logits of the rows to sample (None if none); the prompt rows' logprobs go to
        batch.prompt_result, computed a slice of rows at a time. Under tensor parallelism every rank runs this on
        the same batch, in step."""
        self.install_packs(batch.input_ids.shape[0])
        with inference_mode():
            hidden = self.forward(batch)
            if batch.prompt_rows:
                num_sampled = hidden.shape[0] - len(batch.prompt_rows)
                batch.prompt_result = prompt_row_logprobs(hidden[num_sampled:], batch.prompt_targets, batch.prompt_k,
                                                          self.info.vocab_size, self.model.compute_logits)
                hidden = hidden[:num_sampled]
            return self.model.compute_logits(hidden) if hidden.shape[0] else None

    def sample(self, items: list[BatchItem], batch: Batch, logits: Tensor | None) -> list[SampleOutput | None]:
        results: list[SampleOutput | None] = [None] * len(items)
        if batch.prompt_result is not None:
            fill_prompt_logprobs(batch.prompt_result, items)
        if logits is None:
            return results
        resolve_masks(items)  # masks that follow the step: the forward pass ran while they came
        with inference_mode():
            if all(plain_greedy(items[i].sampling) and items[i].token_mask is None for i in batch.sample_items):
                samples = self.sampler.greedy(logits)
            else:
                samples = self.sampler.sample(logits, [sample_request(items[i]) for i in batch.sample_items])
        for i, sample in zip(batch.sample_items, samples, strict=True):
            results[i] = sample
        return results

    def forward(self, batch: Batch) -> Tensor:
        """Final hidden states of the sampled rows: a CUDA graph replay for decode steps that fit one, a compiled
        graph for steps that fit one."""
        if self.graphs is not None and batch.decode_only:
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is not None:
                return hidden.index_select(0, batch.output_rows)
        if self.compiled is not None:
            hidden = self.compiled.run(batch.input_ids, batch.positions, batch.meta)
            if hidden is not None:
                return hidden.index_select(0, batch.output_rows)
        return self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache.layers, batch.rows_to_keep())


def load_draft_model(config: ExecutorConfig, model_dir: Path, model_cfg: ModelConfig, backend: TorchBackend,
                     kv_cache: KVCache, ops: ModelOps, parallel: ParallelContext, dtype: torch.dtype) -> DraftModel:
    """--draft-model: the draft model on the model's device and dtype, checked to share its tokenizer, over a KV
    cache of its own with the model's block size and block counts (a block id means the same in both)."""
    if parallel.world_size > 1:
        raise ValueError("--draft-model: not with tensor parallelism (its step channel carries no drafts)")
    draft_dir = Path(str(config.draft_model))
    try:
        draft_cfg = ModelConfig.from_dir(draft_dir)
    except (OSError, ValueError) as e:
        raise ValueError(f"--draft-model {draft_dir}: {e}") from None
    check_draft_vocabulary(draft_dir, draft_cfg, model_dir, model_cfg)
    draft = load_model(draft_dir, device=backend.device, dtype=dtype, ops=ops)
    shape = CacheShape(draft_cfg.num_layers, kv_cache.shape.block_size, draft.layout.num_kv_heads,
                       draft_cfg.head_dim, kv_cache.shape.dtype)
    cache = KVCache(shape, num_device_blocks=kv_cache.num_device_blocks, num_swap_blocks=kv_cache.num_swap_blocks,
                    device=backend.device, huge_pages=kv_cache.huge_pages)
    log.info("draft model %s: %d layers, its own KV cache of %d device and %d swap blocks", draft_dir,
             draft_cfg.num_layers, kv_cache.num_device_blocks, kv_cache.num_swap_blocks)
    info, device = backend.info, backend.device  # what build_batch reads of them is settled by now
    return DraftModel(draft, cache, lambda items: build_batch(items, info, device))  # no cycle through the backend


def startup_cache(config: ExecutorConfig, parallel: ParallelContext = SINGLE) -> MeasureCache:
    """Where start-up measurements are kept: --startup-cache-dir ("" turns the cache off; default
    $PAGEDSERVE_CACHE_DIR/startup or ~/.cache/pagedserve/startup), one entry per tensor-parallel rank."""
    if config.startup_cache_dir == "":
        return MeasureCache(None)
    directory = Path(config.startup_cache_dir) if config.startup_cache_dir else default_cache_dir()
    return MeasureCache(directory, parallel.rank, parallel.world_size)


def inference_mode() -> AbstractContextManager[object]:
    """torch.inference_mode(), or nothing where it is on already."""
    return nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()


def choose_packing(config: ExecutorConfig, model: LlamaForCausalLM, parallel: ParallelContext,
                   pipeline: PackWhileReading | None) -> Packing:
    """One rank: the packs made while reading, finished (the cache's choice, else the rule's, measured after ready);
    under tensor parallelism: packed now, as the start-up cache says or as measured now."""
    if pipeline is not None:
        packing = pipeline.finish(model.packable_linears())
    else:
        packing = model.pack_weights(config.cpu_gemm, config.cpu_skinny_rows, startup_cache(config, parallel),
                                     measure_later=parallel.world_size == 1)
    done = "to be packed after ready" if packing.deferred else "packed"
    log.info("linear weights %s for %s; skinny kernel up to %d rows%s", done, packing.gemm or "nothing (F.linear)",
             packing.skinny_rows, packing_origin(packing))
    return packing


def packing_origin(packing: Packing) -> str:
    if packing.cached:
        return " (as the start-up cache measured)"
    if packing.kept:  # measured now (tensor parallelism)
        return f" (measured; {packing.kept})"
    return " (provisional: measuring in the background after ready)" if packing.provisional else ""


def done_future() -> Future[list[SampleOutput | None]]:
    future: Future[list[SampleOutput | None]] = Future()
    future.set_result([])
    return future


def model_ops(device: torch.device, dtype: torch.dtype) -> ModelOps:
    """The device's attention kernels; on the CPU in float32, RoPE and the KV write, RMSNorm with the residual add
    and SiLU-and-multiply, fused in C++ where it builds."""
    write_kv, paged_attention = get_attention_ops(device)
    if device.type == "cpu" and dtype == torch.float32 and cpu_ops.load():
        return ModelOps(write_kv, paged_attention, cpu_ops.rope_write_kv, cpu_ops.rms_norm, cpu_ops.add_rms_norm,
                        cpu_ops.silu_and_mul)
    return ModelOps(write_kv, paged_attention)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device cuda was requested but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    if name == "cpu":
        return torch.device("cpu")
    raise ValueError(f"device must be auto, cuda or cpu, got {name!r}")


def resolve_dtype(requested: str, model_dtype: str, device: torch.device) -> torch.dtype:
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {requested!r}")
        return DTYPES[requested]
    if device.type != "cuda":
        return torch.float32
    dtype = DTYPES.get(model_dtype, torch.float16)
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return torch.float16
    return dtype


def resolve_kv_cache_dtype(requested: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype: auto is the model's dtype; float16 anywhere on the CPU (the C++ kernels read and write it
    under a float32 model, the torch reference under others), on a GPU only where the model is float16 itself."""
    if requested == "auto":
        return dtype
    if requested != "float16":
        raise ValueError(f"--kv-cache-dtype must be auto or float16, got {requested!r}")
    if device.type == "cuda" and dtype != torch.float16:
        raise ValueError(f"--kv-cache-dtype float16: on a GPU the KV cache takes the model's dtype "
                         f"({str(dtype).removeprefix('torch.')}); use auto")
    return torch.float16


def warm_up_steps(num_window_groups: int, device: torch.device) -> list[list[BatchItem]]:
    """One greedy decode step of WARM_UP_ROWS one-token sequences in block 0 (written over by the first request
    that uses it); on CUDA also a prefill step of one two-token sequence, so that both of the Triton attention
    kernel's variants compile before ready, also where --num-gpu-blocks skips the memory profile's pass."""
    greedy = SamplingConfig(temperature=0.0)
    windows = [[0]] * num_window_groups
    decode = [BatchItem(f"warm-up-{i}", [0], 1, 0, 1, [0], True, greedy, window_tables=windows)
              for i in range(WARM_UP_ROWS)]
    if device.type != "cuda":
        return [decode]
    prefill = BatchItem("warm-up-prefill", [0, 0], 2, 0, 2, [0, 0], True, greedy,
                        window_tables=[[0, 0]] * num_window_groups)
    return [decode, [prefill]]


def count_device_blocks(config: ExecutorConfig, model: LlamaForCausalLM, sampler: Sampler, shape: CacheShape,
                        device: torch.device, layer_slots: tuple[int, ...] | None = None) -> int:
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if device.type != "cuda":
        return shape.blocks_in(config.cpu_kv_cache_space)
    return profile_cuda_blocks(config, model, sampler, shape, device, layer_slots)


def count_swap_blocks(config: ExecutorConfig, shape: CacheShape) -> int:
    if config.num_cpu_blocks is not None:
        return config.num_cpu_blocks
    return shape.blocks_in(config.swap_space)


def profile_cuda_blocks(config: ExecutorConfig, model: LlamaForCausalLM, sampler: Sampler, shape: CacheShape,
                        device: torch.device, layer_slots: tuple[int, ...] | None = None) -> int:
    """Peak memory of a max_num_batched_tokens forward + sampling max_num_seqs rows decides what is left for KV
    blocks."""
    if not 0.0 < config.gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    num_tokens = max(1, config.max_num_batched_tokens)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    scratch = KVCache(shape, num_device_blocks=math.ceil(num_tokens / shape.block_size), num_swap_blocks=0,
                      device=device, layer_slots=layer_slots)
    run_profile_pass(model, sampler, scratch, num_tokens, device, max(1, config.max_num_seqs))
    torch.cuda.synchronize(device)
    scratch_bytes = scratch.num_device_blocks * shape.bytes_per_block
    peak = torch.cuda.max_memory_allocated(device) - scratch_bytes
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    del scratch
    torch.cuda.empty_cache()
    available = total * config.gpu_memory_utilization - peak - non_torch
    blocks = int(available // shape.bytes_per_block)
    if blocks <= 0:
        raise RuntimeError(
            f"no memory left for the KV cache: {total / 2**30:.2f} GiB total"
            f" x {config.gpu_memory_utilization} utilisation, {(peak + non_torch) / 2**30:.2f} GiB used by"
            " weights and activations; raise"
            " --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return blocks


def run_profile_pass(model: LlamaForCausalLM, sampler: Sampler, cache: KVCache, num_tokens: int,
                     device: torch.device, sample_rows: int = PROFILE_SAMPLE_ROWS) -> None:
    positions = torch.arange(num_tokens, device=device)
    meta = profile_metadata(num_tokens, cache.num_device_blocks, device)
    rows = min(num_tokens, sample_rows)  # a step samples at most --max-num-seqs rows
    output_rows = torch.arange(num_tokens - rows, num_tokens, device=device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta, cache.layers, output_rows))
        request = SampleRequest(SamplingConfig(temperature=1.0, top_p=0.9, top_k=50), (), 0, 0)
        sampler.sample(logits, [request] * rows)


def profile_metadata(num_tokens: int, num_blocks: int, device: torch.device) -> AttentionMetadata:
    """One sequence of num_tokens new tokens over blocks 0, 1, ...: the memory profile's forward pass."""
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
    )


def build_info(config: ExecutorConfig, model_dir: Path, model_cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, max_model_len: int, num_device_blocks: int,
               num_swap_blocks: int) -> BackendInfo:
    tokenizer = read_tokenizer_files(model_dir, model_cfg)
    return BackendInfo(
        model_id=model_dir.resolve().name,
        vocab_size=model_cfg.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids,
        max_model_len=max_model_len,
        block_size=config.block_size,
        num_device_blocks=num_device_blocks,
        num_swap_blocks=num_swap_blocks,
        dtype=str(dtype).removeprefix("torch."),
        device=device.type,
        tokenizer_json=tokenizer.tokenizer_json,
        bos_token_id=tokenizer.bos_token_id,
        add_bos_token=tokenizer.add_bos_token,
        chat_template=tokenizer.chat_template,
        architecture=model_cfg.architecture,
        sliding_windows=tuple(w or 0 for w in model_cfg.layer_windows),
    )


def resolve_max_model_len(requested: int | None, cfg: ModelConfig) -> int:
    limit = cfg.max_position_embeddings
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested


def validate_item(item: BatchItem, info: BackendInfo) -> None:
    end = item.start + item.num_tokens
    if item.start < 0 or end > len(item.token_ids):
        raise ValueError(
            f"request {item.request_id}: cannot compute positions [{item.start}, {end}) of"
            f" {len(item.token_ids)} known tokens"
        )
    if item.sample and end != len(item.token_ids):
        raise ValueError(f"request {item.request_id}: sample=True needs the pass to end at the last token")
    try:
        check_span(item.start, item.num_tokens, len(item.block_table), info.block_size, info.max_model_len)
        if len(item.window_tables) != info.kv_window_groups:
            raise RequestRefused(f"{len(item.window_tables)} window tables, not {info.kv_window_groups}")
        for table in item.window_tables:
            check_span(item.start, item.num_tokens, len(table), info.block_size, info.max_model_len)
    except RequestRefused as e:
        raise ValueError(f"request {item.request_id}: {e}") from None


def window_group_metas(items: list[BatchItem], meta: AttentionMetadata, layout: KVLayout, info: BackendInfo,
                       device: torch.device) -> list[AttentionMetadata]:
    """Per layer, the attention metadata of its group: the batch's own for the full-attention layers, one built
    from each window group's tables (slots and block tables; the same lengths) for the window layers. Rings: the
    window layers read the step's keys fresh and write only each sequence's last `window` positions (the ones
    before are never read again, and would share a ring slot with later ones)."""
    groups = [replace(meta, layer_metas=None)]  # a copy: the batch's own meta will hold the list (no cycle to pickle)
    for g in range(layout.num_window_groups):
        grouped = [replace(item, block_table=list(item.window_tables[g])) for item in items]
        group_meta = build_batch(grouped, info, device).meta
        group_meta = replace(group_meta, seq_lens=meta.seq_lens, query_start_loc=meta.query_start_loc)
        if info.kv_window_ring:
            group_meta = replace(group_meta, read_fresh=True,
                                 slot_mapping=ring_slots(group_meta.slot_mapping, meta.query_start_loc, layout.window))
        groups.append(group_meta)
    return [groups[g] for g in layout.layer_groups]


def ring_slots(slot_mapping: Tensor, query_start_loc: Tensor, window: int) -> Tensor:
    """slot_mapping with -1 for the rows before each sequence's last `window` rows of the step."""
    starts = query_start_loc.tolist()
    skipped = [(a, b - window) for a, b in pairwise(starts) if b - a > window]
    if not skipped:
        return slot_mapping
    masked = slot_mapping.clone()
    for a, b in skipped:
        masked[a:b] = -1
    return masked


def build_batch(items: list[BatchItem], info: BackendInfo, device: torch.device) -> Batch:
    if all(item.num_tokens == 1 for item in items):
        batch = build_decode_batch(items, info, device)
        if batch is not None:
            return batch
    return build_mixed_batch(items, info, device)


def build_decode_batch(items: list[BatchItem], info: BackendInfo, device: torch.device) -> Batch | None:
    """build_mixed_batch's tensors for a step of one token per item, from Python lists in one pass; None
    where a block id or token id is out of range (build_mixed_batch then raises its error)."""
    block_size, n = info.block_size, len(items)
    starts = [item.start for item in items]
    tables = [item.block_table[: start // block_size + 1] for item, start in zip(items, starts, strict=True)]
    width = max(map(len, tables))
    if any(len(t) != width for t in tables):
        tables = [t + [0] * (width - len(t)) for t in tables]
    flat = list(chain.from_iterable(tables))
    input_ids = [item.token_ids[start] for item, start in zip(items, starts, strict=True)]
    if (min(flat) < 0 or max(flat) >= info.num_device_blocks or min(input_ids) < 0
            or max(input_ids) >= info.vocab_size):
        return None
    slots = [table[start // block_size] * block_size + start % block_size
             for table, start in zip(tables, starts, strict=True)]
    sample_items = [i for i, item in enumerate(items) if item.sample]
    longs = to_device(np.array([*input_ids, *starts, *slots, *sample_items], dtype=np.int64), device)
    ints = to_device(np.array([*(s + 1 for s in starts), *range(n + 1), *flat], dtype=np.int32), device)
    meta = AttentionMetadata(slot_mapping=longs[2 * n:3 * n], block_tables=ints[2 * n + 1:].view(n, width),
                             seq_lens=ints[:n], query_start_loc=ints[n:2 * n + 1])
    return Batch(longs[:n], longs[n:2 * n], meta, longs[3 * n:], sample_items, True, every_row=len(sample_items) == n)


def to_device(values: np.ndarray, device: torch.device) -> Tensor:
    tensor = torch.from_numpy(values)
    return tensor if device.type == "cpu" else tensor.to(device)


def build_mixed_batch(items: list[BatchItem], info: BackendInfo, device: torch.device) -> Batch:
    block_size, num_blocks = info.block_size, info.num_device_blocks
    starts = torch.tensor([item.start for item in items], dtype=torch.long)
    q_lens = torch.tensor([item.num_tokens for item in items], dtype=torch.long)
    seq_lens = starts + q_lens
    query_start_loc = torch.zeros(len(items) + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    tables = [item.block_table[: -(-(item.start + item.num_tokens) // block_size)] for item in items]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    if int(block_tables.min()) < 0 or int(block_tables.max()) >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks}), got {block_tables.unique().tolist()}")
    seq_index = torch.repeat_interleave(torch.arange(len(items)), q_lens)
    total = int(query_start_loc[-1])
    positions = torch.arange(total) - query_start_loc[seq_index] + starts[seq_index]
    slot_mapping = block_tables[seq_index, positions // block_size] * block_size + positions % block_size
    chunks = (item.token_ids[item.start : item.start + item.num_tokens] for item in items)
    input_ids = torch.tensor(list(chain.from_iterable(chunks)), dtype=torch.long)
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= info.vocab_size:
        raise ValueError(f"token ids must be in [0, {info.vocab_size})")
    sample_items = [i for i, item in enumerate(items) if item.sample]
    output_rows = query_start_loc[1:][sample_items] - 1
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
    )
    return Batch(input_ids.to(device), positions.to(device), meta, output_rows.to(device), sample_items,
                 total == len(items))


def sample_request(item: BatchItem) -> SampleRequest:
    return SampleRequest(item.sampling, item.token_ids, item.num_prompt_tokens, len(item.token_ids), item.token_mask)
