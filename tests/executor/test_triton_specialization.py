"""The Triton kernels compile once per kind of step, not once per batch: Triton keys its compiled kernels on the
class of each integer argument (1, a multiple of 16, other) and each pointer's 16-byte alignment, and a key that
changed with the batch size or the block table's width cost a compile of ~1 s in the middle of serving on an H200.
The keys are computed here on the CPU, as Triton's launcher computes them, from the arguments the executor's own
batch builders give the kernels."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

from executor_service.attention import triton_paged
from executor_service.backend import BackendInfo, BatchItem, SamplingConfig
from executor_service.runner.torch_backend import build_decode_batch, build_mixed_batch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 64, 16
INFO = BackendInfo("m", vocab_size=100, eos_token_ids=(), max_model_len=4096, block_size=BLOCK_SIZE,
                   num_device_blocks=4096, num_swap_blocks=0, dtype="float32", device="cpu")
BATCH_SIZES = [1, 2, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 40, 64, 100, 128]


class Recorder:
    """Stands in for a kernel: kernel[grid](*args, **constexprs) records the call."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **constexprs: self.calls.append((args, constexprs))


def specialization_key(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any]) -> tuple[Any, ...]:
    if isinstance(kernel, JITFunction):
        jit = kernel
    else:  # an interpreted kernel (TRITON_INTERPRET=1) keeps the jit options it was given
        jit = JITFunction(kernel.fn, **{name: kernel.kwargs[name]
                                        for name in ("do_not_specialize", "do_not_specialize_on_alignment")})
    keys = tuple(native_specialize_impl(BaseBackend, arg, p.is_const, not p.do_not_specialize,
                                        not p.do_not_specialize_on_alignment)
                 for p, arg in zip(jit.params, args, strict=False))
    return keys + tuple(sorted(constexprs.items()))


def items(n: int, prefill: bool, rng: random.Random) -> list[BatchItem]:
    out = []
    for i in range(n):
        length = rng.randrange(2, 600)
        start = rng.randrange(length) if prefill else length - 1
        blocks = rng.sample(range(INFO.num_device_blocks), -(-length // BLOCK_SIZE))
        out.append(BatchItem(str(i), [1] * length, 1, start, length - start, blocks, True, SamplingConfig()))
    return out


def keys_of_steps(monkeypatch: pytest.MonkeyPatch, prefill: bool) -> set[tuple[Any, ...]]:
    attention, write = Recorder(), Recorder()
    monkeypatch.setattr(triton_paged, "_paged_attention_kernel", attention)
    monkeypatch.setattr(triton_paged, "_write_kv_kernel", write)
    k_cache = torch.zeros(INFO.num_device_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    rng = random.Random(0)
    for n in BATCH_SIZES:
        step = items(n, prefill, rng)
        batch = build_mixed_batch(step, INFO, torch.device("cpu")) if prefill else build_decode_batch(
            step, INFO, torch.device("cpu"))
        assert batch is not None
        tokens = batch.input_ids.numel()
        qkv = torch.zeros(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM)  # the model's one projection, split as views
        query, key, value = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
        key, value = key.view(tokens, KV_HEADS, HEAD_DIM), value.view(tokens, KV_HEADS, HEAD_DIM)
        triton_paged.write_kv(key, value, k_cache, v_cache, batch.meta.slot_mapping)
        meta = batch.meta
        triton_paged.paged_attention(query.view(tokens, HEADS, HEAD_DIM), k_cache, v_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, HEAD_DIM**-0.5)
    monkeypatch.undo()
    widths = {args[4].stride(0) for args, _ in attention.calls}
    assert len(widths) > 5, "the steps should have block tables of many widths"
    return ({specialization_key(triton_paged._paged_attention_kernel, *call) for call in attention.calls}
            | {specialization_key(triton_paged._write_kv_kernel, *call) for call in write.calls})


def test_decode_steps_of_every_batch_size_share_one_compiled_kernel_each(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(keys_of_steps(monkeypatch, prefill=False)) == 2  # the attention kernel's and write_kv's


def test_prefill_steps_of_every_batch_size_share_one_compiled_kernel_each(monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(keys_of_steps(monkeypatch, prefill=True)) == 2
