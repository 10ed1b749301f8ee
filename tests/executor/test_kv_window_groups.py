"""Hybrid models served with sliding-window KV cache groups, end to end in one process: the scheduler core plans
the steps (each window group's table a ring of ceil(window / block_size) + 1 blocks), step_proto builds the
Execute message, the executor's servicer validates and runs it on the torch backend (window layers read their
rings and the step's own keys, then write), result_from_proto brings the tokens back. Greedy tokens equal
transformers' for prompts and outputs longer than the window, with prefill chunks shorter and longer than the
window, under swap and recompute preemption and with prefix caching on, while every block the scheduler holds
free is poisoned with NaN before each step: a read of a block the request does not hold would change the
tokens, and so would a step's write over ring keys its own queries still read."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from executor_service.config import ExecutorConfig
from executor_service.runner.kv_groups import KVLayout, plan_layout
from executor_service.runner.torch_backend import TorchBackend
from executor_service.server import ExecutorServicer, serve
from protos.contract import ring_blocks
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from scheduler_service.core.config import CoreConfig, PreemptionMode
from scheduler_service.core.outputs import SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.engine.executor_link import result_from_proto, step_proto
from scheduler_service.engine.executor_loop import executor_limits
from tests.executor.test_model_families import VOCAB, WINDOW, hf_family_model
from tests.executor.test_torch_model import assert_same_tokens, hf_greedy, make_prompt
from tests.support.procs import loopback, start_listening, stop, wait_healthy

transformers = pytest.importorskip("transformers")

HYBRID = ("gemma2", "gemma3", "gpt_oss")
WINDOW_ONLY = ("mistral", "qwen2", "phi3", "mixtral")  # every layer slides: one window group, no block table
BLOCK = 8
NEW_TOKENS = 24  # past the window: decode steps release blocks too
PROMPTS = (40, 90, 27)


@dataclass
class Hybrid:
    path: Path
    backend: TorchBackend
    hf: Any
    expected: dict[int, list[int]]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Hybrid] = {}

    def get(name: str) -> Hybrid:
        if name not in cache:
            path = hf_family_model(tmp_path_factory.mktemp(name), name, seed=11)
            backend = TorchBackend.create(ExecutorConfig(model=str(path), device="cpu", block_size=BLOCK,
                                                         num_gpu_blocks=400, num_cpu_blocks=400, seed=0))
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
            expected = {n: hf_greedy(hf, make_prompt(n, seed=n, vocab=VOCAB), NEW_TOKENS) for n in PROMPTS}
            cache[name] = Hybrid(path, backend, hf, expected)
        return cache[name]

    return get


@dataclass
class Served:
    tokens: dict[str, list[int]]
    scheduler: Scheduler
    peak_window_blocks: int


async def serve_requests(backend: TorchBackend, prompts: dict[str, list[int]], cfg: CoreConfig,
                         num_device_blocks: int, poison_cached: bool) -> Served:
    """Every prompt through the scheduler core and the executor's servicer (greedy, NEW_TOKENS each), the later
    ones arriving as the earlier ones run; before each step the blocks the scheduler holds free (but those the step
    swaps out first) are set to NaN (with poison_cached, cached ones too: only without prefix caching, where nothing
    may read them)."""
    servicer = ExecutorServicer(backend)
    describe = await servicer.Describe(executor_pb2.DescribeRequest(), None)

    def poison(s: Scheduler, out: SchedulerOutput) -> None:
        free = s.kv.device.free_blocks() if poison_cached else set(s.kv.device._empty)
        free -= {src for src, _ in out.swap_out}  # the step copies them out before anything else
        if free:
            backend.kv_cache.device_kv[:, :, sorted(free)] = float("nan")

    return await drive(describe, servicer.run_step, prompts, cfg, num_device_blocks, poison)


async def drive(describe: executor_pb2.DescribeResponse,
                run_step: Callable[[executor_pb2.StepRequest], Awaitable[executor_pb2.StepResult]],
                prompts: dict[str, list[int]], cfg: CoreConfig, num_device_blocks: int,
                poison: Callable[[Scheduler, SchedulerOutput], None] | None = None) -> Served:
    """The scheduler core's loop over an executor that run_step reaches (in process or over gRPC)."""
    caps = describe.capabilities
    assert caps.kv_window_groups > 0 and caps.kv_window == WINDOW
    assert caps.kv_window_only == (describe.architecture in ONLY_ARCHITECTURES)
    limits = replace(executor_limits(describe), num_device_blocks=num_device_blocks)
    s = Scheduler(cfg, limits)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    peak = 0
    for step in range(2000):
        if pending and step % 3 == 0:
            rid, prompt = pending.pop(0)
            s.add_request(Request(rid, list(prompt), SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                     ignore_eos=True), 0.0))
        if not pending and not s.has_unfinished():
            break
        out = s.schedule()
        if poison is not None:
            poison(s, out)
        for r in s.running:
            table = s.kv.window_table(r.request_id)
            peak = max(peak, table.length if table is not None else 0)
            assert not caps.kv_window_only or s.kv.block_table(r.request_id) == []  # the ring is all it holds
        result = await run_step(step_proto(out))
        assert not result.error and not result.errors, (result.error, list(result.errors))
        for delta in s.update(out, result_from_proto(result, out)):
            assert delta.finish_reason in (None, FinishReason.LENGTH), delta
            tokens[delta.request_id] += delta.new_token_ids
    assert not s.has_unfinished()
    assert s.kv.device.num_free == num_device_blocks
    return Served(tokens, s, peak)


def request_prompts(copies: int = 1) -> dict[str, list[int]]:
    return {f"p{n}-{c}": make_prompt(n, seed=n, vocab=VOCAB) for c in range(copies) for n in PROMPTS}


def check_tokens(model: Hybrid, served: Served) -> None:
    for rid, tokens in served.tokens.items():
        n = int(rid[1:].split("-")[0])
        assert_same_tokens(tokens, model.expected[n], model.backend.info.eos_token_ids)


ONLY_ARCHITECTURES = ("MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM")
RING = ring_blocks(WINDOW, BLOCK)  # a window group's blocks per request, at most: ceil(16 / 8) + 1 = 3


@pytest.mark.parametrize("chunk", [8, 32])  # prefill chunks shorter and longer than the window
@pytest.mark.parametrize("name", HYBRID + WINDOW_ONLY)
def test_greedy_tokens_equal_transformers_with_free_blocks_poisoned(hybrid: Any, name: str, chunk: int) -> None:
    model = hybrid(name)
    cfg = CoreConfig(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    served = asyncio.run(serve_requests(model.backend, request_prompts(), cfg, 400, poison_cached=True))
    check_tokens(model, served)
    # a window group's ring: ceil(window / block_size) + 1 blocks at most, while prefill chunks run too
    assert served.peak_window_blocks == RING


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
@pytest.mark.parametrize("name", HYBRID)
def test_preemption_keeps_the_tokens(hybrid: Any, name: str, mode: PreemptionMode) -> None:
    """A pool that holds about one and a half requests: the others are preempted (swapped out with their window
    rings, or recomputed) and come back with transformers' tokens."""
    model = hybrid(name)
    groups = model.backend.info.kv_window_groups
    one = -(-(max(PROMPTS) + NEW_TOKENS) // BLOCK) + groups * RING
    cfg = CoreConfig(max_num_batched_tokens=32, enable_prefix_caching=False, preemption_mode=mode)
    served = asyncio.run(serve_requests(model.backend, request_prompts(2), cfg, one * 3 // 2, poison_cached=True))
    check_tokens(model, served)
    stats = served.scheduler.stats()
    assert (stats.num_preemptions_swap if mode is PreemptionMode.SWAP else stats.num_preemptions_recompute) > 0
    assert served.peak_window_blocks == RING


@pytest.mark.parametrize("mode", [PreemptionMode.SWAP, PreemptionMode.RECOMPUTE])
@pytest.mark.parametrize("name", WINDOW_ONLY)
def test_window_only_preemption_keeps_the_tokens(hybrid: Any, name: str, mode: PreemptionMode) -> None:
    """Every layer slides: a request holds its ring of RING blocks and nothing else. With a pool of 2 * RING - 1
    blocks and steps of one block (max_num_batched_tokens = BLOCK), the first request decodes holding its full
    ring while the second's prefill grows its ring a block a step: its third block cannot fit, so a request is
    preempted (swapped out with its ring, or recomputed) whatever the timing; every token is transformers'."""
    model = hybrid(name)
    assert model.backend.info.kv_window_only and model.backend.info.kv_window_groups == 1
    cfg = CoreConfig(max_num_batched_tokens=BLOCK, enable_prefix_caching=False, preemption_mode=mode)
    served = asyncio.run(serve_requests(model.backend, request_prompts(2), cfg, 2 * RING - 1, poison_cached=True))
    check_tokens(model, served)
    stats = served.scheduler.stats()
    assert (stats.num_preemptions_swap if mode is PreemptionMode.SWAP else stats.num_preemptions_recompute) > 0
    assert served.peak_window_blocks == RING


@pytest.mark.parametrize("name", HYBRID + WINDOW_ONLY)
def test_prefix_caching_on_keeps_the_tokens_without_window_hits(hybrid: Any, name: str) -> None:
    """The same prompts again with prefix caching on: rings are overwritten in place, so they are never cached
    and a hybrid model gets no hit (a full-attention hit alone would leave the window layers without their keys);
    the tokens stay transformers'."""
    model = hybrid(name)
    cfg = CoreConfig(max_num_batched_tokens=32, enable_prefix_caching=True)
    served = asyncio.run(serve_requests(model.backend, request_prompts(3), cfg, 400, poison_cached=False))
    check_tokens(model, served)
    assert served.scheduler.stats().prefix_cache_hits == 0


async def test_the_executor_checks_window_rings_and_keeps_them(hybrid: Any) -> None:
    """Over gRPC: the torch executor says it keeps rings; a new request without its window tables, with a ring
    longer than ceil(window / block_size) + 1, starting past block 0 or too short for its step is refused; a
    request's ring stays held after it computed past the window (a copy onto it is refused)."""
    model = hybrid("gemma2")
    server, port = await serve(model.backend, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            assert (await stub.Describe(executor_pb2.DescribeRequest())).capabilities.kv_window_ring
            call = stub.Execute()

            async def step(step_id: int, **fields: Any) -> executor_pb2.StepResult:
                await call.write(executor_pb2.StepRequest(step_id=step_id, **fields))
                return await call.read()

            prompt = make_prompt(40, seed=5, vocab=VOCAB)
            sampling = common_pb2.SamplingParams(temperature=0.0)

            def new(rid: str, num_tokens: int, blocks: list[int], ring: list[int], start: int = 0) -> Any:
                return executor_pb2.NewRequest(request_id=rid, token_ids=prompt, num_prompt_tokens=40,
                                               num_scheduled_tokens=num_tokens, block_ids=blocks,
                                               window_block_ids=ring, window_block_start=start, sampling=sampling)

            refused = {"bare": (new("bare", 40, [0, 1, 2, 3, 4], []), "window tables"),
                       "long": (new("long", 16, [0, 1], [5, 6, 7, 8]), "more than its 3"),
                       "late": (new("late", 16, [0, 1], [5, 6], start=1), "rings"),
                       "short": (new("short", 40, [0, 1, 2, 3, 4], [5, 6]), "window tables")}
            for rid, (request, reason) in refused.items():
                result = await step(1, new_requests=[request])
                assert [e.request_id for e in result.errors] == [rid] and reason in result.errors[0].message, rid
            assert not (await step(2, new_requests=[new("a", 16, [20, 21, 22, 23, 24], [10, 11, 12])])).errors
            rest = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[24], num_new_blocks=[0])
            result = await step(3, running=rest)
            assert not result.error and not result.errors and list(result.sampled.request_ids) == ["a"]
            # a has computed 40 tokens, past its window: its whole ring is still its own
            for block in (10, 11, 12):
                copy = [executor_pb2.BlockMapping(src=20, dst=block)]
                assert "held by live request 'a'" in (await step(4 + block, copy=copy)).error
            grown = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[1],
                                                 new_block_ids=[25], num_new_window_blocks=[1],
                                                 new_window_block_ids=[13], window_block_start=[0])
            result = await step(20, running=grown)
            assert "more than its 3" in result.errors[0].message
            await call.done_writing()
    finally:
        await server.stop(None)


def test_layers_are_cut_into_groups_of_equal_size() -> None:
    gemma3_1b = [None if i % 6 == 5 else 512 for i in range(26)]  # 4 full-attention layers, 22 window layers
    layout = plan_layout(gemma3_1b, release=True)
    assert layout.page_layers == 4 and layout.num_window_groups == 6 and layout.window == 512  # the last one padded
    assert [layout.layer_groups[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [layout.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    pairs = {(layout.layer_groups[i], layout.layer_slots[i]) for i in range(26)}
    assert len(pairs) == 26  # no two layers share a group's page slot
    assert plan_layout([None, 16, None, 16], release=True).num_window_groups == 1
    only = plan_layout([16, 16, 8], release=True)  # every layer slides: one window group of them all
    assert (only.page_layers, only.num_window_groups, only.window, only.window_only) == (3, 1, 16, True)
    assert only.layer_groups == (1, 1, 1) and only.layer_slots == (0, 1, 2)
    assert plan_layout([16, 16], release=False) == KVLayout.single(2)
    assert plan_layout([None, 16], release=False) == KVLayout.single(2)


async def test_a_window_only_executor_refuses_a_block_table(hybrid: Any) -> None:
    """Every layer slides: Describe says kv_window_only, a block table sent beside the ring is refused naming the
    field, and a request sent with its ring alone runs past its window."""
    model = hybrid("mistral")
    servicer = ExecutorServicer(model.backend)
    describe = await servicer.Describe(executor_pb2.DescribeRequest(), None)
    assert describe.capabilities.kv_window_only and describe.capabilities.kv_window_groups == 1
    prompt = make_prompt(40, seed=5, vocab=VOCAB)
    sampling = common_pb2.SamplingParams(temperature=0.0)
    with_table = executor_pb2.NewRequest(request_id="t", token_ids=prompt, num_prompt_tokens=40,
                                         num_scheduled_tokens=40, block_ids=[0, 1, 2, 3, 4],
                                         window_block_ids=[5, 6, 7], sampling=sampling)
    result = await servicer.run_step(executor_pb2.StepRequest(step_id=1, new_requests=[with_table]))
    assert [e.request_id for e in result.errors] == ["t"] and "block_ids" in result.errors[0].message
    ring_only = executor_pb2.NewRequest(request_id="r", token_ids=prompt, num_prompt_tokens=40,
                                        num_scheduled_tokens=40, window_block_ids=[5, 6, 7], sampling=sampling)
    result = await servicer.run_step(executor_pb2.StepRequest(step_id=2, new_requests=[ring_only]))
    assert not result.error and not result.errors and list(result.sampled.request_ids) == ["r"]
    assert list(result.sampled.token_ids) == hf_greedy(model.hf, prompt, 1)


@pytest.mark.parametrize("name", ["gemma2", "mistral"])
async def test_tensor_parallel_size_2_serves_the_rings(hybrid: Any, name: str, tmp_path: Path) -> None:
    """`--tensor-parallel-size 2` (two gloo ranks): every rank plans the same KV cache groups and the step channel
    carries each layer's metadata, so the executor advertises window rings (window-only for the Mistral) and a
    hybrid and a window-only model give transformers' tokens through the scheduler core over gRPC, holding R blocks
    per ring, with requests swapped out and back in (the pool fits one and a half of them, as above)."""
    model = hybrid(name)
    only = name in WINDOW_ONLY
    groups = model.backend.info.kv_window_groups
    chunk = BLOCK if only else 32
    pool = 2 * RING - 1 if only else (-(-(max(PROMPTS) + NEW_TOKENS) // BLOCK) + groups * RING) * 3 // 2
    proc, ports = start_listening("executor_service", [
        "--model", str(model.path), "--device", "cpu", "--tensor-parallel-size", "2", "--block-size", str(BLOCK),
        "--num-gpu-blocks", str(pool), "--num-cpu-blocks", "400"], tmp_path / "executor.log")
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            describe = await stub.Describe(executor_pb2.DescribeRequest())
            assert describe.capabilities.kv_window_ring and describe.capabilities.kv_window_groups == groups
            call = stub.Execute()

            async def run_step(step: executor_pb2.StepRequest) -> executor_pb2.StepResult:
                await call.write(step)
                return await call.read()

            cfg = CoreConfig(max_num_batched_tokens=chunk, enable_prefix_caching=False,
                             preemption_mode=PreemptionMode.SWAP)
            served = await drive(describe, run_step, request_prompts(2), cfg, pool)
            await call.done_writing()
    finally:
        assert stop(proc) == 0, (tmp_path / "executor.log").read_text()[-3000:]
    check_tokens(model, served)
    assert served.scheduler.stats().num_preemptions_swap > 0 and served.peak_window_blocks == RING
