"""Every step the executor serves on a GPU runs a Triton kernel that start-up has already compiled. Triton keys its
compiled kernels on the class of each integer argument (1, a multiple of 16, other) and on each pointer's 16-byte
alignment; a key that changed with the batch size, the block table's width or where the metadata lie cost a compile
of ~1 s in the middle of serving on an H200. The keys are computed here on the CPU, as Triton's launcher computes
them, from the arguments that the executor's own start-up passes (the memory profile, the warm-up steps, CUDA-graph
capture) and batch builders give the kernels."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from executor_service.attention import triton_paged
from executor_service.backend import BackendInfo, BatchItem, SamplingConfig
from executor_service.model.llama import Attention, AttentionMetadata
from executor_service.runner.cuda_graphs import StaticInputs
from executor_service.runner.torch_backend import build_batch, profile_metadata, warm_up_steps

native_specialize_impl = pytest.importorskip("triton._C.libtriton").native_specialize_impl
BaseBackend = pytest.importorskip("triton.backends.compiler").BaseBackend
JITFunction = pytest.importorskip("triton.runtime.jit").JITFunction

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
INFO = BackendInfo("m", vocab_size=100, eos_token_ids=(), max_model_len=4096, block_size=BLOCK_SIZE,
                   num_device_blocks=4096, num_swap_blocks=0, dtype="float32", device="cpu")
CPU = torch.device("cpu")
BATCH_SIZES = [1, 2, 3, 4, 5, 15, 16, 17, 33, 64, 100, 129]
LONGEST = [3, 40, 256, 257, 600, 999, 512, 20, 100, 700, 33, 900]  # block tables 1 - 63 wide, 16 and 32 among them
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# the model's Attention.split_rope, on a module of this shape (q, k: rotary views of one new tensor; v: a view of qkv)
SHAPE = SimpleNamespace(q_size=HEADS * HEAD_DIM, kv_size=KV_HEADS * HEAD_DIM, num_heads=HEADS,
                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


class Recorder:
    """Stands in for a kernel: kernel[grid](*args, **constexprs) records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **constexprs: self.calls.append((args, constexprs))


def jit_function(kernel: Any) -> Any:
    if isinstance(kernel, JITFunction):
        return kernel
    # an interpreted kernel (TRITON_INTERPRET=1) keeps the jit options it was given
    return JITFunction(kernel.fn, **{name: kernel.kwargs[name]
                                     for name in ("do_not_specialize", "do_not_specialize_on_alignment")})


def specialization_key(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any]) -> tuple[Any, ...]:
    params = jit_function(kernel).params
    keys = tuple(native_specialize_impl(BaseBackend, arg, p.is_const, not p.do_not_specialize,
                                        not p.do_not_specialize_on_alignment)
                 for p, arg in zip(params, args, strict=False))
    return (kernel.fn.__name__, *keys, *sorted(constexprs.items()))


class Kernels:
    """The attention layer's two Triton calls, as the model makes them, recorded instead of run."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kernels = (triton_paged._paged_attention_kernel, triton_paged._write_kv_kernel)
        self.recorders = (Recorder(), Recorder())
        monkeypatch.setattr(triton_paged, "_paged_attention_kernel", self.recorders[0])
        monkeypatch.setattr(triton_paged, "_write_kv_kernel", self.recorders[1])
        self.k_cache = torch.zeros(INFO.num_device_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.v_cache = torch.zeros_like(self.k_cache)

    def run(self, meta: AttentionMetadata, tokens: int) -> set[tuple[Any, ...]]:
        """The keys of one layer's calls for a step of `tokens` tokens."""
        qkv = torch.zeros(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        cos = sin = torch.zeros(tokens, 1, HEAD_DIM // 2)
        query, key, value = Attention.split_rope(SHAPE, qkv, cos, sin)  # type: ignore[arg-type]
        triton_paged.write_kv(key, value, self.k_cache, self.v_cache, meta.slot_mapping)
        triton_paged.paged_attention(query, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, HEAD_DIM**-0.5)
        keys = set()
        for kernel, recorder in zip(self.kernels, self.recorders, strict=True):
            keys |= {specialization_key(kernel, *call) for call in recorder.calls}
            recorder.calls.clear()
        return keys

    def run_items(self, items: list[BatchItem]) -> set[tuple[Any, ...]]:
        batch = build_batch(items, INFO, CPU)
        return self.run(batch.meta, batch.input_ids.numel())


def step_items(n: int, longest: int, kind: str, rng: random.Random) -> list[BatchItem]:
    """n sequences, the first of `longest` tokens and the others shorter: each decoding one token, or each computing
    a chunk (prefill), or both."""
    items = []
    for i in range(n):
        length = longest if i == 0 else rng.randrange(2, longest + 1)
        chunk = kind == "prefill" or (kind == "mixed" and i % 3 == 0)
        start = rng.randrange(length) if chunk else length - 1
        blocks = rng.sample(range(INFO.num_device_blocks), -(-length // BLOCK_SIZE))
        items.append(BatchItem(str(i), [1] * length, 1, start, length - start, blocks, True, SamplingConfig()))
    return items


def serving_steps(kernels: Kernels, kind: str) -> Iterator[set[tuple[Any, ...]]]:
    rng = random.Random(kind)
    for n, longest in zip(BATCH_SIZES, LONGEST, strict=True):
        yield kernels.run_items(step_items(n, longest, kind, rng))


def start_up(kernels: Kernels, profile: bool, graphs: bool) -> set[tuple[Any, ...]]:
    keys: set[tuple[Any, ...]] = set()
    if profile:  # skipped under --num-gpu-blocks
        keys |= kernels.run(profile_metadata(2048, 2048 // BLOCK_SIZE, CPU), 2048)
    for items in warm_up_steps(0, torch.device("cuda")):
        keys |= kernels.run_items(items)
    if graphs:
        inputs = StaticInputs.allocate(GRAPH_SIZES[-1], INFO.max_model_len // BLOCK_SIZE, CPU)
        for size in GRAPH_SIZES:
            keys |= kernels.run(inputs.meta(size), size)
    return keys


@pytest.mark.parametrize(("profile", "graphs"), [(True, False), (False, False), (True, True)],
                         ids=["profiled", "num-gpu-blocks", "cuda-graphs"])
def test_every_step_runs_a_kernel_that_start_up_compiled(monkeypatch: pytest.MonkeyPatch, profile: bool,
                                                         graphs: bool) -> None:
    kernels = Kernels(monkeypatch)
    compiled = start_up(kernels, profile, graphs)
    assert len(compiled) == 3  # write_kv, and attention's decode and prefill variants
    for kind in ("decode", "prefill", "mixed"):
        for n, keys in zip(BATCH_SIZES, serving_steps(kernels, kind), strict=True):
            assert keys <= compiled, f"a {kind} step of {n} sequences would compile a new kernel"


def test_the_steps_cover_tables_of_many_widths() -> None:
    for kind in ("decode", "prefill", "mixed"):
        rng = random.Random(kind)  # as serving_steps draws them
        widths = {build_batch(step_items(n, longest, kind, rng), INFO, CPU).meta.block_tables.stride(0)
                  for n, longest in zip(BATCH_SIZES, LONGEST, strict=True)}
        assert {1, 16, 17, 32, 63} <= widths, (kind, widths)
