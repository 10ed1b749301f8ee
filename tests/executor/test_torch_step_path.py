"""The torch backend's per-step path: the decode-only batch fast path gives the general path's tensors and errors;
short decode steps run on the event loop's thread, everything else on the forward thread."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from executor_service.backend import BackendInfo, BatchItem, SampleOutput, SamplingConfig
from executor_service.config import ExecutorConfig
from executor_service.default_model.model import make_model
from executor_service.runner.sampler import SampleRequest
from executor_service.runner.torch_backend import (
    INLINE_STEP_S,
    Batch,
    DecodeTime,
    TorchBackend,
    build_batch,
    build_decode_batch,
    build_mixed_batch,
)

INFO = BackendInfo("m", vocab_size=100, eos_token_ids=(), max_model_len=512, block_size=4, num_device_blocks=64,
                   num_swap_blocks=0, dtype="float32", device="cpu")
CPU = torch.device("cpu")


def decode_items(n: int, seed: int) -> list[BatchItem]:
    rng = random.Random(seed)
    items = []
    for i in range(n):
        length = rng.randrange(1, 40)
        tokens = [rng.randrange(INFO.vocab_size) for _ in range(length)]
        start = length - 1 if rng.random() < 0.8 else rng.randrange(length)  # some recompute a past token
        table = rng.sample(range(INFO.num_device_blocks), start // INFO.block_size + 1 + rng.randrange(3))
        items.append(BatchItem(str(i), tokens, 1, start, 1, table, start + 1 == length, SamplingConfig()))
    return items


def assert_same(fast: Batch, general: Batch) -> None:
    for name in ("input_ids", "positions", "output_rows"):
        a, b = getattr(fast, name), getattr(general, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        a, b = getattr(fast.meta, name), getattr(general.meta, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert (fast.sample_items, fast.decode_only) == (general.sample_items, general.decode_only)


@pytest.mark.parametrize(("n", "seed"), [(1, 0), (2, 1), (7, 2), (64, 3), (64, 4)])
def test_decode_fast_path_equals_general_path(n: int, seed: int) -> None:
    items = decode_items(n, seed)
    fast = build_decode_batch(items, INFO, CPU)
    assert fast is not None
    assert_same(fast, build_mixed_batch(items, INFO, CPU))
    assert_same(build_batch(items, INFO, CPU), fast)


def test_a_step_with_a_prefill_chunk_takes_the_general_path() -> None:
    items = decode_items(5, 5)
    items[2] = replace(items[2], start=0, num_tokens=len(items[2].token_ids), sample=True)
    batch = build_batch(items, INFO, CPU)
    assert not batch.decode_only
    assert_same(batch, build_mixed_batch(items, INFO, CPU))


@pytest.mark.parametrize(("change", "message"), [
    ({"block_table": [INFO.num_device_blocks]}, "block ids must be in"),
    ({"block_table": [-1]}, "block ids must be in"),
    ({"token_ids": [INFO.vocab_size]}, "token ids must be in"),
    ({"token_ids": [-3]}, "token ids must be in"),
])
def test_decode_fast_path_raises_the_general_errors(change: dict[str, list[int]], message: str) -> None:
    items = decode_items(4, 6)
    fields: dict[str, Any] = {"token_ids": [5], "block_table": [3], **change}
    items[1] = replace(items[1], start=0, **fields)
    assert build_decode_batch(items, INFO, CPU) is None
    with pytest.raises(ValueError, match=message) as fast:
        build_batch(items, INFO, CPU)
    with pytest.raises(ValueError, match=message) as general:
        build_mixed_batch(items, INFO, CPU)
    assert str(fast.value) == str(general.value)


def test_decode_time_scales_with_the_batch() -> None:
    assert DecodeTime().expected_s(1) == float("inf")
    assert DecodeTime(0.004, 8).expected_s(4) == 0.004
    assert DecodeTime(0.004, 8).expected_s(32) == pytest.approx(0.016)


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures("one_thread")
def test_short_decode_steps_and_verifications_run_inline_and_others_on_the_forward_thread(tmp_path: Path) -> None:
    """At one forward thread there is no OpenMP pool to keep to one thread."""
    model = make_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64)
    backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4, num_gpu_blocks=32))
    threads: list[str] = []
    execute = backend.execute
    release = threading.Event()

    def recorded(items: list[BatchItem]) -> list[SampleOutput | None]:
        threads.append(threading.current_thread().name)
        if items[0].request_id == "blocked":
            release.wait()
        return execute(items)

    backend.execute = recorded  # type: ignore[method-assign]
    tokens = [5, 6, 7, 8, 9]
    prefill = BatchItem("a", tokens, 5, 0, 5, [0, 1], True, SamplingConfig(temperature=0.0))
    decode = replace(prefill, start=4, num_tokens=1)

    async def steps() -> None:
        await backend.execute_async([prefill])  # a prefill: forward thread
        await backend.execute_async([decode])  # the first decode: its time is unknown, forward thread
        assert backend._last_decode.expected_s(1) < INLINE_STEP_S
        await backend.execute_async([decode])  # inline
        await backend.execute_async([replace(decode, draft_token_ids=(9, 9))])  # a short verification: inline
        stuck = asyncio.ensure_future(backend.execute_async([replace(prefill, request_id="blocked")]))
        while len(threads) < 5:
            await asyncio.sleep(0)  # let the blocked step start on the forward thread
        stuck.cancel()  # its stream went away; the pass still runs on the forward thread
        after = asyncio.ensure_future(backend.execute_async([decode]))
        await asyncio.sleep(0)  # it chooses its thread while the cancelled pass still runs
        release.set()
        await after  # queued behind the cancelled pass, not run beside it

    asyncio.run(steps())
    assert threads == ["forward_0", "forward_0", "MainThread", "MainThread", "forward_0", "forward_0"]


def test_with_two_forward_threads_every_pass_runs_on_the_forward_thread(tmp_path: Path) -> None:
    """One OpenMP pool (#29): libgomp gives every thread that opens a parallel region a pool of its own, so passes
    inline on the loop's thread beside passes on the forward thread would mean two pools and more OpenMP threads
    than cores; warm-up included."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = make_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64)
        threads: list[str] = []
        warm_up = TorchBackend.warm_up

        def recorded_warm_up(self: TorchBackend) -> None:
            threads.append(threading.current_thread().name)
            warm_up(self)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(TorchBackend, "warm_up", recorded_warm_up)
            backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4,
                                                         num_gpu_blocks=32))
        execute = backend.execute

        def recorded(items: list[BatchItem]) -> list[SampleOutput | None]:
            threads.append(threading.current_thread().name)
            return execute(items)

        backend.execute = recorded  # type: ignore[method-assign]
        prefill = BatchItem("a", [5, 6, 7, 8, 9], 5, 0, 5, [0, 1], True, SamplingConfig(temperature=0.0))
        decode = replace(prefill, start=4, num_tokens=1)

        async def steps() -> None:
            await backend.execute_async([prefill])
            await backend.execute_async([decode])
            assert backend._last_decode.expected_s(1) < INLINE_STEP_S  # short: inline at one thread
            await backend.execute_async([decode])

        asyncio.run(steps())
    finally:
        torch.set_num_threads(before)
    assert threads == ["forward_0"] * 4


def test_on_forward_thread_runs_there_and_hands_back_the_result_or_the_error(tmp_path: Path) -> None:
    """What benchmarks time passes through (#29): on the thread whose OpenMP team the executor's passes use."""
    model = make_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64)
    backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4, num_gpu_blocks=32))
    prefill = BatchItem("a", [5, 6, 7, 8, 9], 5, 0, 5, [0, 1], True, SamplingConfig(temperature=0.0))
    try:
        name, [sampled] = backend.on_forward_thread(
            lambda: (threading.current_thread().name, backend.execute([prefill])))
        assert name == "forward_0" and sampled is not None and 0 <= sampled.token_id < 64
        with pytest.raises(ValueError, match="block ids must be in"):
            backend.on_forward_thread(lambda: backend.execute([replace(prefill, block_table=[0, 99])]))
    finally:
        backend.close()


def decode_step(items: list[BatchItem], **sampling: Any) -> list[BatchItem]:
    """The items as a step of one token each (the last one), sampled with `sampling`."""
    config = SamplingConfig(temperature=0.0, **sampling)
    return [replace(i, start=len(i.token_ids) - 1, num_tokens=1, sample=True, sampling=config) for i in items]


def test_a_decode_step_that_samples_every_row_keeps_them_without_gathering(tmp_path: Path) -> None:
    """Every row sampled: the forward pass is told to keep all rows (None), and its final hidden states equal those
    of the same step where one row is computed but not sampled (the gathered path), row for row (#29)."""
    model = make_model(tmp_path / "m", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=64)
    backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4, num_gpu_blocks=32))
    backend.wait_for_packing()  # no kernel swapped in between the two passes
    rng = random.Random(5)
    prompts = [[rng.randrange(64) for _ in range(6)] for _ in range(3)]
    items = [BatchItem(str(i), p, 6, 0, 6, [2 * i, 2 * i + 1], False, SamplingConfig()) for i, p in enumerate(prompts)]
    backend.execute(items)
    step = decode_step(items)
    every = backend.prepare(step)
    some = backend.prepare([*step[:2], replace(step[2], sample=False)])
    assert every.every_row and every.rows_to_keep() is None
    assert not some.every_row and some.rows_to_keep() is not None
    with torch.inference_mode():  # (the final norm is per row: the same bits whether rows were gathered before it)
        all_rows, two_rows = backend.forward(every), backend.forward(some)
    assert all_rows.shape[0] == 3 and two_rows.shape[0] == 2
    assert torch.equal(all_rows[:2], two_rows)


@pytest.mark.parametrize("sampling", [{"logprobs": 2}, {"min_tokens": 5}, {"logit_bias": ((7, 100.0),)},
                                      {"repetition_penalty": 2.0}])
def test_greedy_rows_that_ask_for_more_than_the_argmax_leave_the_greedy_shortcut(tmp_path: Path,
                                                                               sampling: dict[str, Any]) -> None:
    """The plain greedy shortcut (argmax only) is taken only where every row is plain: a row with logprobs gets
    them, min_tokens masks EOS, a logit_bias and a penalty move the argmax, as the sampler's full path does."""
    model = make_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=64)
    backend = TorchBackend.create(ExecutorConfig(model=str(model), device="cpu", block_size=4, num_gpu_blocks=32))
    rng = random.Random(6)
    prompts = [[rng.randrange(64) for _ in range(6)] for _ in range(2)]
    items = [BatchItem(str(i), p, 6, 0, 6, [2 * i, 2 * i + 1], False, SamplingConfig()) for i, p in enumerate(prompts)]
    backend.execute(items)
    plain = decode_step(items)
    batch = backend.prepare(plain)
    with torch.inference_mode():
        logits = backend.run_batch(batch)
    assert logits is not None
    argmax = logits.argmax(dim=-1).tolist()
    if "min_tokens" in sampling:  # EOS is the argmax: masked below min_tokens
        backend.sampler.eos_token_ids = (argmax[1],)
    if "repetition_penalty" in sampling:  # every token seen: the penalty moves the argmax where logits are mixed
        plain = [replace(i, token_ids=[*range(64), i.token_ids[-1]], num_prompt_tokens=65, start=64) for i in plain]
    asked = [plain[0], replace(plain[1], sampling=SamplingConfig(temperature=0.0, **sampling))]
    expected = backend.sampler.sample(logits, [SampleRequest(i.sampling, i.token_ids, i.num_prompt_tokens,
                                                             len(i.token_ids)) for i in asked])
    got = backend.sample(asked, batch, logits)
    assert [s.token_id for s in got if s] == [s.token_id for s in expected]
    assert got[0] is not None and got[0].token_id == argmax[0]
    if "logprobs" in sampling:
        assert got[1] is not None and got[1].logprob is not None and len(got[1].top_logprobs) == 2
    if "min_tokens" in sampling or "logit_bias" in sampling:
        assert (got[1] is not None and got[1].token_id != argmax[1]) or argmax[1] == 7
