"""Executor conformance: the Executor contract checked over real gRPC against any executor.

With `PAGEDSERVE_EXECUTOR=HOST:PORT[,HOST:PORT...]` set, the suite tests those addresses only, each in turn
(every executor of a pool: docs/operations.md shows how on Kubernetes). Otherwise it starts the
simulated executor, the torch executor on the embedded default model (small pools) and the same with
--tensor-parallel-size 2 as real processes on loopback and runs every test against each (the window-ring tests
against two simulated executors with rings: one whose every layer slides, Capabilities.kv_window_only, one not).
Every test opens its own Execute stream (a new stream drops all state, so tests cannot leak into each other) and
uses greedy, seeded requests, so two runs of the same request are comparable token for token.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from protos.contract import ring_blocks
from protos.pagedserve.v1 import common_pb2, executor_pb2, executor_pb2_grpc
from tests.support.procs import loopback, start_listening, stop, wait_healthy

ENV = "PAGEDSERVE_EXECUTOR"
STEP_TIMEOUT_S = 60.0
SEED = 1234
SAMPLING = common_pb2.SamplingParams(temperature=0.0, seed=SEED, ignore_eos=True, max_tokens=4096)
EXECUTORS: dict[str, list[str]] = {
    "simulated": ["--simulated", "--num-gpu-blocks", "64", "--num-cpu-blocks", "64", "--sim-eos-rate", "0.1"],
    "torch": ["--num-gpu-blocks", "64", "--num-cpu-blocks", "64",
              "--device", os.environ.get("PAGEDSERVE_TEST_DEVICE", "cpu")],
    # two ranks over gloo (a CUDA run needs two devices: benchmarks/gpu_check.sh does that one)
    "torch-tp2": ["--num-gpu-blocks", "64", "--num-cpu-blocks", "64", "--device", "cpu", "--tensor-parallel-size", "2"],
}
# Executors with sliding-window rings (Capabilities.kv_window_ring), for the window tests only: the rest of the suite
# sends block tables alone. One where every layer slides (kv_window_only) and one where some layer reads the table.
SIM_WINDOW = ["--simulated", "--num-gpu-blocks", "64", "--num-cpu-blocks", "64", "--block-size", "16",
              "--sim-kv-window", "24", "--sim-kv-window-groups", "1", "--sim-kv-window-ring"]
WINDOW_EXECUTORS: dict[str, list[str]] = {"simulated-window-only": [*SIM_WINDOW, "--sim-kv-window-only"],
                                          "simulated-window-ring": SIM_WINDOW}


def targets(ours: dict[str, list[str]]) -> list[str]:
    """Every address in PAGEDSERVE_EXECUTOR (comma-separated: each executor of a pool), else our own."""
    external = [a.strip() for a in os.environ.get(ENV, "").split(",") if a.strip()]
    return [f"external:{a}" for a in external] or list(ours)


def serve_target(target: str, ours: dict[str, list[str]], tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[str]:
    """The address of an external target, or of one of ours started for the module."""
    if target.startswith("external:"):
        yield target.removeprefix("external:")
        return
    log = tmp_path_factory.mktemp(f"executor-{target}") / "executor.log"
    proc, ports = start_listening("executor_service", ours[target], log)
    address = loopback(ports["listen"])
    try:
        wait_healthy(address, proc)
        yield address
    finally:
        stop(proc)


@pytest.fixture(scope="module", params=targets(EXECUTORS))
def executor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve_target(request.param, EXECUTORS, tmp_path_factory)


@pytest.fixture(scope="module", params=targets(WINDOW_EXECUTORS))
def window_executor(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from serve_target(request.param, WINDOW_EXECUTORS, tmp_path_factory)


# ---- a minimal scheduler speaking the protocol -------------------------------------------------


@dataclass
class Seq:
    """One request as the test's scheduler sees it."""

    rid: str
    tokens: list[int]
    num_prompt: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    ring: list[int] = field(default_factory=list)  # its window ring, on an executor with kv_window_ring
    swap_blocks: list[int] = field(default_factory=list)
    live: bool = False  # the executor holds its state
    resume: bool = False  # swapped back in: the next step sends its whole table with resumed=True
    sampling: common_pb2.SamplingParams = field(default_factory=lambda: SAMPLING)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[self.num_prompt:]


@dataclass
class Running:
    """One running request's diff; a step carries them as the columns of RunningRequests."""

    request_id: str
    new_block_ids: list[int]
    num_scheduled_tokens: int
    resumed: bool = False
    new_ring_ids: list[int] = field(default_factory=list)  # blocks its window ring grows by


def columns(running: list[Running], rings: bool = False) -> executor_pb2.RunningRequests:
    """The RunningRequests columns; with rings (Capabilities.kv_window_ring, one window group) the window columns."""
    run = executor_pb2.RunningRequests(
        request_ids=[r.request_id for r in running], num_scheduled_tokens=[r.num_scheduled_tokens for r in running],
        num_new_blocks=[len(r.new_block_ids) for r in running],
        new_block_ids=[b for r in running for b in r.new_block_ids], resumed=[r.resumed for r in running])
    if rings:
        run.num_new_window_blocks.extend(len(r.new_ring_ids) for r in running)
        run.new_window_block_ids.extend(b for r in running for b in r.new_ring_ids)
        run.window_block_start.extend(0 for _ in running)
    return run


def sampled_tokens(result: executor_pb2.StepResult) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    tokens = iter(result.sampled.token_ids)
    for rid, n in zip(result.sampled.request_ids, result.sampled.num_tokens, strict=True):
        out[rid] = [next(tokens) for _ in range(n)]
    return out


class Session:
    """One Execute stream plus the block bookkeeping a scheduler would do."""

    def __init__(self, stub: executor_pb2_grpc.ExecutorStub, describe: executor_pb2.DescribeResponse) -> None:
        self.stub = stub
        self.describe = describe
        self.block_size = describe.block_size
        self.free = list(range(describe.num_device_blocks))
        self.free_swap = list(range(describe.num_swap_blocks))
        self.call = stub.Execute()
        self.step_id = 0

    def prompt(self, length: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        high = min(self.describe.vocab_size, 4096)
        return [rng.randrange(3, high) for _ in range(length)]

    def seq(self, rid: str, length: int, seed: int) -> Seq:
        tokens = self.prompt(length, seed)
        return Seq(rid, tokens, len(tokens))

    def take(self, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
        picked = [b for b in self.free if b not in avoid][:n]
        assert len(picked) == n, f"the test needs {n} more device blocks than the executor has free"
        for b in picked:
            self.free.remove(b)
        return picked

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    async def step(self, running_requests: list[Running] = (), **fields: object) -> executor_pb2.StepResult:  # type: ignore[assignment]
        self.step_id += 1
        rings = self.describe.capabilities.kv_window_ring
        step = executor_pb2.StepRequest(step_id=self.step_id, running=columns(running_requests, rings), **fields)  # type: ignore[arg-type]
        await self.call.write(step)
        result = await asyncio.wait_for(self.call.read(), STEP_TIMEOUT_S)
        assert result is not grpc.aio.EOF, "the executor closed the stream"
        assert result.step_id == self.step_id
        return result

    def work(self, seq: Seq, n: int, extra_slots: int = 0,
             avoid: set[int] | frozenset[int] = frozenset()
             ) -> executor_pb2.NewRequest | Running:
        """The message that schedules n tokens of seq, growing its table (and its window ring, on an executor with
        rings; the ring alone where every layer slides, Capabilities.kv_window_only) as a scheduler would."""
        caps = self.describe.capabilities
        end = seq.computed + n + extra_slots
        added = [] if caps.kv_window_only else self.take(max(0, self.blocks_for(end) - len(seq.blocks)), avoid)
        seq.blocks += added
        ring = self.grow_ring(seq, end, avoid) if caps.kv_window_ring else []
        if not seq.live:
            return executor_pb2.NewRequest(
                request_id=seq.rid, token_ids=seq.tokens, num_prompt_tokens=seq.num_prompt,
                num_computed_tokens=seq.computed, num_scheduled_tokens=n, block_ids=seq.blocks,
                window_block_ids=seq.ring, sampling=seq.sampling)
        if seq.resume:
            return Running(seq.rid, seq.blocks, n, resumed=True)
        return Running(seq.rid, added, n, new_ring_ids=ring)

    def grow_ring(self, seq: Seq, end: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """The blocks seq's window ring grows by to hold positions below `end`: it grows until it has
        ceil(kv_window / block_size) + 1 blocks or covers the request (Capabilities.kv_window_ring)."""
        size = ring_blocks(self.describe.capabilities.kv_window, self.block_size)
        added = self.take(max(0, min(size, self.blocks_for(end)) - len(seq.ring)), avoid)
        seq.ring += added
        return added

    async def run(self, work: list[tuple[Seq, int]], num_steps: int = 1,
                  avoid: set[int] | frozenset[int] = frozenset(), **fields: object) -> executor_pb2.StepResult:
        """One step that must succeed: a token per completed request (num_steps of them), none otherwise."""
        new: list[executor_pb2.NewRequest] = []
        running: list[Running] = []
        for seq, n in work:
            msg = self.work(seq, n, num_steps - 1, avoid)
            (new if isinstance(msg, executor_pb2.NewRequest) else running).append(msg)  # type: ignore[arg-type]
        result = await self.step(new_requests=new, running_requests=running, num_steps=num_steps, **fields)
        assert not result.error, f"step refused: {result.error}"
        assert not result.errors, f"request errors: {[(e.request_id, e.message) for e in result.errors]}"
        outputs = sampled_tokens(result)
        for seq, n in work:
            seq.live, seq.resume = True, False
            seq.computed += n
            got = outputs.pop(seq.rid, [])
            if seq.computed < len(seq.tokens):
                assert got == [], f"{seq.rid}: a partial prefill chunk returned tokens {got}"
                continue
            assert len(got) == num_steps, f"{seq.rid}: expected {num_steps} token(s), got {got}"
            assert all(0 <= t < self.describe.vocab_size for t in got)
            seq.tokens += got
            seq.computed = len(seq.tokens) - 1
        assert not outputs, f"tokens for requests not in the step: {outputs}"
        return result

    async def decode(self, seqs: list[Seq], steps: int) -> None:
        for _ in range(steps):
            await self.run([(s, 1) for s in seqs])

    async def generate(self, seq: Seq, num_outputs: int) -> None:
        await self.run([(seq, len(seq.tokens) - seq.computed)])
        await self.decode([seq], num_outputs - 1)

    def finish(self, seq: Seq) -> str:
        """Forget seq here and return its id for finished_ids; its blocks go back to the free list."""
        self.free = seq.blocks + seq.ring + self.free
        seq.blocks, seq.ring, seq.live = [], [], False
        return seq.rid

    def swap_out(self, seq: Seq) -> list[executor_pb2.BlockMapping]:
        seq.swap_blocks = self.free_swap[: len(seq.blocks)]
        assert len(seq.swap_blocks) == len(seq.blocks), "the executor has too few swap blocks for this test"
        del self.free_swap[: len(seq.blocks)]
        mapping = [executor_pb2.BlockMapping(src=d, dst=s) for d, s in zip(seq.blocks, seq.swap_blocks, strict=True)]
        self.free = seq.blocks + self.free
        seq.blocks = []
        return mapping

    def swap_in(self, seq: Seq, avoid: set[int]) -> list[executor_pb2.BlockMapping]:
        seq.blocks = self.take(len(seq.swap_blocks), avoid)
        mapping = [executor_pb2.BlockMapping(src=s, dst=d) for s, d in zip(seq.swap_blocks, seq.blocks, strict=True)]
        self.free_swap += seq.swap_blocks
        seq.swap_blocks, seq.resume = [], True
        return mapping


@pytest.fixture
async def session(executor: str) -> AsyncIterator[Session]:
    async for s in open_session(executor):
        yield s


@pytest.fixture
async def window_session(window_executor: str) -> AsyncIterator[Session]:
    async for s in open_session(window_executor):
        yield s


async def open_session(executor: str) -> AsyncIterator[Session]:
    async with grpc.aio.insecure_channel(executor) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        describe = await stub.Describe(executor_pb2.DescribeRequest(), timeout=30)
        s = Session(stub, describe)
        try:
            yield s
        finally:
            s.call.cancel()


def refused(result: executor_pb2.StepResult, rid: str) -> bool:
    """The request was refused: named in errors, or the whole step refused; and no token came back for it."""
    named = any(e.request_id == rid and e.message for e in result.errors)
    sampled = bool(sampled_tokens(result).get(rid))
    return (bool(result.error) or named) and not sampled


# ---- the contract ------------------------------------------------------------------------------


async def test_describe_reports_usable_sizes(session: Session) -> None:
    d = session.describe
    assert d.block_size > 0 and d.num_device_blocks > 0
    assert d.vocab_size > 0 and d.max_model_len > 0
    assert list(d.eos_token_ids) and all(0 <= t < d.vocab_size for t in d.eos_token_ids)
    assert d.model_id


async def test_prefill_then_decodes_give_one_token_per_step_as_the_table_grows(session: Session) -> None:
    bs = session.block_size
    a = session.seq("a", max(1, bs - 2), seed=1)
    result = await session.run([(a, len(a.tokens))])
    assert list(result.sampled.request_ids) == ["a"]
    sizes = [len(a.blocks)]
    for _ in range(2 * bs + 3):
        await session.run([(a, 1)])
        sizes.append(len(a.blocks))
    assert len(a.outputs) == 2 * bs + 4
    assert sizes[-1] >= sizes[0] + 2, "the table must have grown through new_block_ids"


async def test_chunked_prefill_first_chunk_returns_no_token(session: Session) -> None:
    if not session.describe.capabilities.chunked_prefill:
        pytest.skip("executor does not support chunked prefill")
    length = 2 * session.block_size + 7
    whole = session.seq("whole", length, seed=2)
    chunked = session.seq("chunked", length, seed=2)
    await session.run([(whole, length), (chunked, session.block_size + 3)])
    assert chunked.outputs == [] and len(whole.outputs) == 1
    await session.run([(chunked, length - chunked.computed), (whole, 1)])
    await session.decode([chunked, whole], 4)
    assert chunked.outputs == whole.outputs[: len(chunked.outputs)] and len(chunked.outputs) == 5


async def test_multi_step_decode_equals_single_steps(session: Session) -> None:
    k = min(4, session.describe.capabilities.max_num_steps)
    if k < 2:
        pytest.skip("executor does not support multi-step decode")
    single = session.seq("single", 11, seed=3)
    multi = session.seq("multi", 11, seed=3)
    await session.run([(single, 11), (multi, 11)])
    await session.decode([single], k)
    await session.run([(multi, 1)], num_steps=k)
    assert multi.outputs == single.outputs and len(multi.outputs) == k + 1


async def test_swap_out_and_in_to_other_blocks_preserves_the_continuation(session: Session) -> None:
    if not session.describe.capabilities.swap or session.describe.num_swap_blocks < 4:
        pytest.skip("executor does not support swap")
    bs = session.block_size
    ref = session.seq("ref", bs + 5, seed=4)
    a = session.seq("a", bs + 5, seed=4)
    await session.run([(ref, len(ref.tokens)), (a, len(a.tokens))])
    await session.decode([ref, a], 3)
    old_blocks = set(a.blocks)
    # Swap a out; in the same step a new request takes a's device blocks and overwrites their KV.
    mapping = session.swap_out(a)
    intruder = session.seq("intruder", len(old_blocks) * bs, seed=5)
    await session.run([(ref, 1), (intruder, len(intruder.tokens))], swapped_out_ids=["a"], swap_out=mapping)
    assert old_blocks <= set(intruder.blocks), "the intruder must reuse the swapped-out blocks"
    await session.decode([ref, intruder], 2)
    # Swap a back in, to blocks it never held, in the step that drops the intruder.
    finished = [session.finish(intruder)]
    mapping = session.swap_in(a, avoid=old_blocks)
    assert not set(a.blocks) & old_blocks
    await session.run([(a, 1), (ref, 1)], avoid=old_blocks, finished_ids=finished, swap_in=mapping)
    await session.decode([a, ref], bs)
    assert a.outputs == ref.outputs[: len(a.outputs)] and len(a.outputs) == bs + 5


async def test_copied_blocks_serve_a_new_request(session: Session) -> None:
    if not session.describe.capabilities.copy:
        pytest.skip("executor does not support copy")
    bs = session.block_size
    dirty = session.seq("dirty", 3 * bs, seed=6)
    await session.run([(dirty, len(dirty.tokens))])
    a = session.seq("a", 2 * bs + 6, seed=7)
    await session.generate(a, 3)
    # Copy a's blocks over the dirty request's blocks; b starts there as a NEW request that has
    # a's computed tokens, in the step that drops the dirty request.
    targets = dirty.blocks[: len(a.blocks)]
    finished = [session.finish(dirty)]
    session.take(len(targets), avoid=set(session.free) - set(targets))
    copy = [executor_pb2.BlockMapping(src=s, dst=d) for s, d in zip(a.blocks, targets, strict=True)]
    b = Seq("b", list(a.tokens), a.num_prompt, computed=a.computed, blocks=list(targets))
    await session.run([(a, 1), (b, 1)], finished_ids=finished, copy=copy)
    assert b.outputs[-1] == a.outputs[-1]
    await session.decode([a, b], 3)
    assert b.outputs == a.outputs


async def test_out_of_range_block_is_refused_and_the_stream_stays_usable(session: Session) -> None:
    n = session.describe.num_device_blocks
    bad_new = executor_pb2.NewRequest(request_id="bad", token_ids=session.prompt(5, seed=8), num_prompt_tokens=5,
                                      num_scheduled_tokens=5, block_ids=[n], sampling=SAMPLING)
    assert refused(await session.step(new_requests=[bad_new]), "bad")
    a = session.seq("a", 5, seed=9)
    await session.generate(a, 2)
    grow = Running("a", [n + 7], 1)
    assert refused(await session.step(running_requests=[grow]), "a")
    after = session.seq("after", 5, seed=9)
    await session.generate(after, 3)
    assert len(after.outputs) == 3


async def test_a_new_request_shares_a_live_requests_computed_prefix_blocks(session: Session) -> None:
    # Prefix caching and n > 1: b holds a's first two (full, computed) blocks as they are and computes
    # only its last tokens into a block of its own; both continue exactly like a solo run.
    bs = session.block_size
    ref = session.seq("ref", 2 * bs + 5, seed=10)
    a = session.seq("a", 2 * bs + 5, seed=10)
    await session.run([(ref, len(ref.tokens)), (a, len(a.tokens))])
    b = Seq("b", list(a.tokens[: 2 * bs + 5]), 2 * bs + 5, computed=2 * bs, blocks=a.blocks[:2] + session.take(1))
    await session.run([(b, 5)])
    assert b.outputs == ref.outputs[:1]
    await session.decode([a, ref, b], 3)
    assert a.outputs == ref.outputs and b.outputs == ref.outputs


async def test_swap_in_or_copy_onto_a_live_block_is_refused_before_it_writes(session: Session) -> None:
    caps = session.describe.capabilities
    if not (caps.swap and caps.copy) or session.describe.num_swap_blocks < 4:
        pytest.skip("executor does not support swap and copy")
    bs = session.block_size
    ref = session.seq("ref", bs + 3, seed=16)
    a = session.seq("a", bs + 3, seed=16)
    other = session.seq("other", bs + 3, seed=17)
    await session.run([(ref, bs + 3), (a, bs + 3), (other, bs + 3)])
    onto_a = [executor_pb2.BlockMapping(src=s, dst=d) for s, d in zip(other.blocks, a.blocks, strict=True)]
    assert (await session.step(copy=onto_a)).error, "a copy onto a live request's block must refuse the step"
    mapping = session.swap_out(other)
    await session.run([(ref, 1), (a, 1)], swapped_out_ids=["other"], swap_out=mapping)
    onto_a = [executor_pb2.BlockMapping(src=m.dst, dst=d) for m, d in zip(mapping, a.blocks, strict=True)]
    resume = Running("other", a.blocks[: len(onto_a)],
                                         num_scheduled_tokens=1, resumed=True)
    assert refused(await session.step(swap_in=onto_a, running_requests=[resume]), "other")
    await session.decode([ref, a], 3)
    assert a.outputs == ref.outputs, "a refused mapping must not have overwritten the live request's KV"


async def test_swap_in_or_copy_past_the_device_pool_is_refused_before_anything_changes(session: Session) -> None:
    caps = session.describe.capabilities
    if not (caps.swap and caps.copy) or session.describe.num_swap_blocks < 4:
        pytest.skip("executor does not support swap and copy")
    n = session.describe.num_device_blocks
    bs = session.block_size
    ref = session.seq("ref", bs + 3, seed=18)
    a = session.seq("a", bs + 3, seed=18)
    await session.run([(ref, bs + 3), (a, bs + 3)])
    mapping = session.swap_out(a)
    await session.run([(ref, 1)], swapped_out_ids=["a"], swap_out=mapping)
    for dst in (n, n + 1, n + 7, 2**32 - 1):  # n: the first id past the pool; 2**32 - 1: the largest uint32
        past = [executor_pb2.BlockMapping(src=a.swap_blocks[0], dst=dst)]
        result = await session.step(swap_in=past)
        assert result.error and not sampled_tokens(result), f"a swap_in to block {dst} must refuse the step"
        past = [executor_pb2.BlockMapping(src=ref.blocks[0], dst=dst)]
        result = await session.step(copy=past)
        assert result.error and not sampled_tokens(result), f"a copy to block {dst} must refuse the step"
    # Nothing of the refused steps happened: a's swap blocks still hold its KV, ref's blocks its own.
    mapping = session.swap_in(a, avoid=set())
    await session.run([(a, 1), (ref, 1)], swap_in=mapping)
    await session.decode([a, ref], 3)
    assert a.outputs == ref.outputs[: len(a.outputs)] and len(a.outputs) == 5


async def test_finished_requests_free_their_blocks_within_the_step(session: Session) -> None:
    a = session.seq("a", 2 * session.block_size, seed=12)
    await session.generate(a, 2)
    blocks = list(a.blocks)
    finished = [session.finish(a)]
    b = session.seq("b", 2 * session.block_size, seed=13)
    b.blocks = session.take(len(blocks), avoid=set(session.free) - set(blocks))
    await session.run([(b, len(b.tokens))], finished_ids=finished)
    assert b.blocks == blocks and len(b.outputs) == 1
    stale = Running("a", [], 1)
    assert refused(await session.step(running_requests=[stale]), "a"), "a finished request must be forgotten"


async def test_num_steps_above_max_num_steps_is_refused_quickly(session: Session) -> None:
    a = session.seq("a", 6, seed=17)
    await session.generate(a, 1)
    limit = session.describe.capabilities.max_num_steps
    started = asyncio.get_running_loop().time()
    result = await session.step(running_requests=[Running("a", [], 1)], num_steps=10**9)
    assert result.error and str(limit) in result.error and not sampled_tokens(result)
    assert asyncio.get_running_loop().time() - started < STEP_TIMEOUT_S


async def test_a_second_stream_is_refused_while_the_first_is_open(session: Session) -> None:
    a = session.seq("a", 10, seed=16)
    await session.generate(a, 2)
    intruder = session.stub.Execute()
    try:
        await intruder.write(executor_pb2.StepRequest(step_id=1, running=columns([Running("a", [], 1)])))
        with pytest.raises(grpc.aio.AioRpcError) as refused_call:
            await asyncio.wait_for(intruder.read(), STEP_TIMEOUT_S)
        assert refused_call.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "one scheduler at a time" in (refused_call.value.details() or "")
    finally:
        intruder.cancel()
    await session.generate(a, 2)  # the first stream's requests are untouched


async def test_a_new_stream_after_the_old_one_ends_drops_its_state(session: Session) -> None:
    a = session.seq("a", 10, seed=14)
    await session.generate(a, 2)
    session.call.cancel()
    session.call = session.stub.Execute()
    resumed = Running("a", [], 1)
    assert refused(await session.step(running_requests=[resumed]), "a")
    # a's blocks are free on the new stream.
    b = session.seq("b", 10, seed=15)
    b.blocks = list(a.blocks)
    await session.generate(b, 2)


async def test_min_tokens_masks_eos_and_stop_tokens_counted_from_the_prompt(session: Session) -> None:
    """min_tokens is a logits mask (vLLM's): while a request has fewer than min_tokens outputs
    (len(token_ids) - num_prompt_tokens), it samples none of Describe.eos_token_ids and none of its
    stop_token_ids, ignore_eos or not; past that it samples as without the mask. The count is the same for a
    request resent as new with its outputs (recompute preemption) and across the steps of a multi-step pass."""
    eos = set(session.describe.eos_token_ids)
    candidates = [session.seq(f"c{i}", 10, seed=100 + i) for i in range(4)]
    await session.run([(c, 10) for c in candidates])
    await session.decode(candidates, 39)
    with_eos = [c for c in candidates if eos & set(c.outputs)]
    if not with_eos:
        pytest.skip("no greedy run of this executor sampled EOS")
    ref = min(with_eos, key=lambda c: next(i for i, t in enumerate(c.outputs) if t in eos))
    first_eos = next(i for i, t in enumerate(ref.outputs) if t in eos)
    common = sorted({t for t in ref.outputs if t not in eos}, key=ref.outputs.count, reverse=True)[:3]
    min_tokens = min(first_eos + 3, 30)
    finished = [session.finish(c) for c in candidates]
    masked = common_pb2.SamplingParams()
    masked.CopyFrom(SAMPLING)
    masked.min_tokens, masked.stop_token_ids[:] = min_tokens, common
    unmasked = common_pb2.SamplingParams()
    unmasked.CopyFrom(masked)
    unmasked.min_tokens = 0

    def like_ref(rid: str, sampling: common_pb2.SamplingParams) -> Seq:
        return Seq(rid, ref.tokens[:10], 10, sampling=sampling)

    m, zero, resent = like_ref("m", masked), like_ref("zero", unmasked), like_ref("resent", masked)
    await session.run([(m, 10), (zero, 10), (resent, 10)], finished_ids=finished)
    await session.decode([m, zero, resent], 2)
    # recompute: resent is dropped and sent again as new with its outputs; its count goes on from 3 outputs
    finished = [session.finish(resent)]
    resent.computed = 0
    await session.run([(m, 1), (zero, 1), (resent, len(resent.tokens))], finished_ids=finished)
    await session.decode([m, zero, resent], min_tokens + 16)
    assert not (eos | set(common)) & set(m.outputs[:min_tokens]), "masked tokens sampled below min_tokens"
    assert zero.outputs == ref.outputs[:len(zero.outputs)], "stop_token_ids without min_tokens changed the tokens"
    assert resent.outputs == m.outputs, "a request resent with its outputs must count them towards min_tokens"
    k = min(4, session.describe.capabilities.max_num_steps)
    if k > 1:
        multi = like_ref("multi", masked)
        finished = [session.finish(s) for s in (m, zero, resent)]
        await session.run([(multi, 10)], finished_ids=finished)
        while len(multi.outputs) < min_tokens + 4:
            await session.run([(multi, 1)], num_steps=k)
        assert multi.outputs == m.outputs[:len(multi.outputs)], "multi-step passes must count outputs too"


# ---- what an executor must refuse: sizes beyond its advertised limits, values outside the contract ------


def advertised(session: Session, name: str) -> int:
    limit: int = getattr(session.describe.capabilities, name)
    if not limit:
        pytest.skip(f"executor does not advertise {name}")
    return limit


async def assert_refused_whole_and_usable(session: Session, result: executor_pb2.StepResult, says: str) -> None:
    assert says in result.error and not sampled_tokens(result) and not result.errors, result
    after = session.seq("after", 6, seed=30)  # the stream stays usable, and nothing of the step was kept
    await session.generate(after, 2)
    assert len(after.outputs) == 2


async def test_describe_advertises_per_step_limits(session: Session) -> None:
    caps = session.describe.capabilities
    for name in ("max_num_batched_tokens", "max_num_seqs", "max_num_lookahead_slots"):
        assert advertised(session, name) >= 1, name
    assert caps.max_num_seqs <= caps.max_num_batched_tokens or caps.max_num_batched_tokens == 0


async def test_a_step_with_more_requests_than_max_num_seqs_is_refused_whole(session: Session) -> None:
    limit = advertised(session, "max_num_seqs")
    prompt = session.prompt(1, seed=31)
    flood = [executor_pb2.NewRequest(request_id=f"r{i}", token_ids=prompt, num_prompt_tokens=1,
                                     num_scheduled_tokens=1, block_ids=[0], sampling=SAMPLING)
             for i in range(limit + 1)]
    result = await session.step(new_requests=flood)
    await assert_refused_whole_and_usable(session, result, "max_num_seqs")


async def test_a_step_with_more_tokens_than_max_num_batched_tokens_is_refused_whole(session: Session) -> None:
    limit = advertised(session, "max_num_batched_tokens")
    d = session.describe
    length = min(d.max_model_len - 1, d.num_device_blocks * d.block_size)
    blocks = list(range(session.blocks_for(length)))
    flood = [executor_pb2.NewRequest(request_id=f"r{i}", token_ids=session.prompt(length, seed=32),
                                     num_prompt_tokens=length, num_scheduled_tokens=length, block_ids=blocks,
                                     sampling=SAMPLING)
             for i in range(limit // length + 1)]
    result = await session.step(new_requests=flood)
    await assert_refused_whole_and_usable(session, result, "max_num_batched_tokens")


async def test_more_lookahead_slots_than_advertised_is_refused_whole(session: Session) -> None:
    limit = advertised(session, "max_num_lookahead_slots")
    a = session.seq("a", 6, seed=33)
    await session.generate(a, 1)
    result = await session.step(running_requests=[Running("a", [], 1)], num_lookahead_slots=max(limit + 1, 2**32 - 1))
    assert "max_num_lookahead_slots" in result.error and not sampled_tokens(result)
    await session.decode([a], 1)  # a is untouched
    assert len(a.outputs) == 2


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", float("nan")), ("top_p", -1.0), ("logprobs", 2**31), ("n", 2**31), ("top_k", -7),
    ("repetition_penalty", float("inf")), ("prompt_logprobs", 2**31),
])
async def test_a_sampling_value_outside_the_contract_is_refused_alone(session: Session, field: str,
                                                                      value: float) -> None:
    bad = session.seq("bad", 6, seed=34)
    work = session.work(bad, 6)
    assert isinstance(work, executor_pb2.NewRequest)
    setattr(work.sampling, field, value)
    good = session.seq("good", 6, seed=34)
    result = await session.step(new_requests=[work, session.work(good, 6)])
    assert refused(result, "bad") and not result.error, result
    assert sampled_tokens(result).get("good"), "the other request of the step runs"


async def test_num_prompt_tokens_past_the_tokens_sent_is_refused(session: Session) -> None:
    lying = executor_pb2.NewRequest(request_id="lying", token_ids=session.prompt(5, seed=35), num_prompt_tokens=6,
                                    num_scheduled_tokens=5, block_ids=session.take(1), sampling=SAMPLING)
    assert refused(await session.step(new_requests=[lying]), "lying")


# ---- sliding-window KV cache groups (#32) ----------------------------------------------------------------------


async def test_window_tables_to_an_executor_without_window_groups_are_refused(session: Session) -> None:
    """An executor whose Describe says kv_window_groups 0 keeps one table for every layer: window tables sent to it
    are refused (the request alone on a new request, the step whole in the running columns), and it goes on."""
    if session.describe.capabilities.kv_window_groups:
        pytest.skip("the executor keeps window tables (tests/executor/test_kv_window_groups.py checks those)")
    a = session.seq("a", 5, seed=40)
    blocks = session.take(2)
    windowed = executor_pb2.NewRequest(request_id="w", token_ids=a.tokens, num_prompt_tokens=5, num_scheduled_tokens=5,
                                       block_ids=blocks[:1], window_block_ids=blocks[1:], sampling=SAMPLING)
    result = await session.step(new_requests=[windowed])
    assert refused(result, "w") and "window_block_ids" in result.errors[0].message
    session.free += blocks
    await session.generate(a, 2)
    grow = executor_pb2.RunningRequests(request_ids=["a"], num_scheduled_tokens=[1], num_new_blocks=[0],
                                        num_new_window_blocks=[0], window_block_start=[0])
    await session.call.write(executor_pb2.StepRequest(step_id=session.step_id + 1, running=grow))
    session.step_id += 1
    result = await asyncio.wait_for(session.call.read(), STEP_TIMEOUT_S)
    assert "kv_window_groups" in result.error and not sampled_tokens(result)
    await session.decode([a], 2)
    assert len(a.outputs) == 4


def ring_executor(session: Session, window_only: bool) -> int:
    """The ring size R = ceil(kv_window / block_size) + 1 of an executor with rings that does (or does not) say
    kv_window_only; the test is skipped for any other."""
    caps = session.describe.capabilities
    if not caps.kv_window_ring or caps.kv_window_only != window_only:
        pytest.skip(f"the executor does not keep window rings with kv_window_only {window_only}")
    assert caps.kv_window_groups >= 1 and caps.kv_window >= 1
    if caps.kv_window_only:  # every layer slides: they are all one window group
        assert caps.kv_window_groups == 1
    return ring_blocks(caps.kv_window, session.block_size)


async def prefill_whole_and_in_chunks(session: Session, length: int, outputs: int) -> tuple[Seq, Seq]:
    """One prompt longer than the ring's span, prefilled whole and, as another request, a block a step, then decoded
    past it; each holds at most its ring (and table) and gets one token a step."""
    whole, chunked = session.seq("whole", length, seed=41), session.seq("chunked", length, seed=41)
    await session.generate(whole, outputs)
    while chunked.computed < chunked.num_prompt:
        await session.run([(chunked, min(session.block_size, chunked.num_prompt - chunked.computed))])
    await session.decode([chunked], outputs - 1)
    assert whole.outputs == chunked.outputs, "a ring prefilled in chunks gives the tokens of one prefilled whole"
    assert len(whole.outputs) == outputs
    return whole, chunked


async def test_a_window_only_executor_is_sent_its_rings_alone(window_session: Session) -> None:
    """Capabilities.kv_window_only (every layer slides): each request is sent its window ring of R blocks and no
    block table; it runs past the ring's span, whole or in prefill chunks alike, holding R blocks. A block table
    sent beside a ring is refused, that request alone, naming block_ids; the stream goes on."""
    session = window_session
    size = ring_executor(session, window_only=True)
    span = size * session.block_size
    whole, chunked = await prefill_whole_and_in_chunks(session, span + session.block_size // 2, span)
    assert (len(whole.ring), whole.blocks, len(chunked.ring), chunked.blocks) == (size, [], size, [])
    lone = session.seq("lone", 6, seed=42)
    table, ring = session.take(1), session.take(1)
    both = executor_pb2.NewRequest(request_id="both", token_ids=lone.tokens, num_prompt_tokens=6,
                                   num_scheduled_tokens=6, block_ids=table, window_block_ids=ring, sampling=SAMPLING)
    result = await session.step(new_requests=[both], running_requests=[Running("whole", [], 1)])
    assert refused(result, "both") and not result.error, result
    assert "block_ids" in result.errors[0].message and "kv_window_only" in result.errors[0].message
    assert len(sampled_tokens(result)["whole"]) == 1, "the other request of the step runs"
    session.free += table + ring
    await session.step(finished_ids=[session.finish(whole), session.finish(chunked)])
    await session.generate(lone, 2)
    assert (len(lone.outputs), len(lone.ring), lone.blocks) == (2, 1, [])


async def test_an_executor_with_rings_but_not_window_only_is_sent_a_block_table_too(window_session: Session) -> None:
    """Capabilities.kv_window_ring without kv_window_only (some layer reads the block table): a request sent its
    ring alone is refused, naming the block table; sent its table and its ring, it runs past the window, whole or in
    prefill chunks alike, its ring holding R blocks while its table covers the sequence."""
    session = window_session
    size = ring_executor(session, window_only=False)
    span = size * session.block_size
    ring = session.take(size)
    lone = session.seq("ring-alone", span, seed=43)
    alone = executor_pb2.NewRequest(request_id="ring-alone", token_ids=lone.tokens, num_prompt_tokens=span,
                                    num_scheduled_tokens=span, window_block_ids=ring, sampling=SAMPLING)
    result = await session.step(new_requests=[alone])
    assert refused(result, "ring-alone") and "block table" in result.errors[0].message, result
    session.free += ring
    whole, chunked = await prefill_whole_and_in_chunks(session, span + session.block_size // 2, span)
    for seq in (whole, chunked):
        assert len(seq.ring) == size and len(seq.blocks) == session.blocks_for(len(seq.tokens) - 1)


# ---- prompt logprobs (#30) ------------------------------------------------------------------------------------


def prompt_logprobs_of(result: executor_pb2.StepResult, rid: str) -> dict[int, common_pb2.TokenLogprobs]:
    """Position -> the executor's prompt logprob entry, for one request of one step."""
    found = [p for p in result.prompt_logprobs if p.request_id == rid]
    assert len(found) <= 1, f"{rid}: more than one PromptLogprobs in one step"
    return {found[0].first_position + i: t for i, t in enumerate(found[0].tokens)} if found else {}


async def test_prompt_logprobs_cover_every_prompt_position_once_across_chunks(session: Session) -> None:
    if not session.describe.capabilities.prompt_logprobs:
        pytest.skip("executor does not compute prompt logprobs")
    length, k = 2 * session.block_size + 7, 3
    sampling = common_pb2.SamplingParams(temperature=0.0, seed=SEED, ignore_eos=True, prompt_logprobs=k)
    whole, chunked, plain = (session.seq(rid, length, seed=40) for rid in ("whole", "chunked", "plain"))
    whole.sampling = chunked.sampling = sampling
    first = await session.run([(whole, length), (chunked, 1), (plain, length)])
    assert prompt_logprobs_of(first, "plain") == {}, "a request that did not ask gets none"
    seen = prompt_logprobs_of(first, "chunked")
    assert sorted(seen) == [1], "the row of position 0 answers position 1"
    by_position = prompt_logprobs_of(first, "whole")
    assert sorted(by_position) == list(range(1, length)), "positions 1 .. P-1, each once"
    for n in (session.block_size, 5, length - 1 - session.block_size - 5):
        result = await session.run([(chunked, n)])
        got = prompt_logprobs_of(result, "chunked")
        start = chunked.computed - n
        assert sorted(got) == list(range(start + 1, min(chunked.computed, length - 1) + 1))
        seen.update(got)
    assert sorted(seen) == list(range(1, length))
    later = await session.run([(whole, 1), (chunked, 1)])
    assert not later.prompt_logprobs, "decode steps answer no prompt logprobs"
    for position, entry in by_position.items():
        other = seen[position]
        assert entry.token_id == other.token_id == whole.tokens[position]
        assert entry.logprob <= 0 and abs(entry.logprob - other.logprob) < 1e-4
        top = [t.logprob for t in entry.top]
        assert len(top) <= k and top == sorted(top, reverse=True)
        assert not top or entry.logprob <= top[0] + 1e-5


# ---- structured outputs: the token mask (#30) ----------------------------------------------------------------


def bitmask(allowed: list[set[int]], vocab_size: int) -> tuple[int, bytes]:
    """(words_per_row, bytes) of rows allowing exactly these token ids: bit t % 32 of little-endian word t // 32."""
    words = -(-vocab_size // 32)
    data = bytearray(4 * words * len(allowed))
    for row, ids in enumerate(allowed):
        for t in ids:
            data[4 * words * row + t // 8] |= 1 << (t % 8)
    return words, bytes(data)


def masks(rows: dict[str, set[int]], vocab_size: int) -> executor_pb2.TokenBitmasks:
    words, data = bitmask(list(rows.values()), vocab_size)
    return executor_pb2.TokenBitmasks(request_ids=list(rows), words_per_row=words, bitmask=data)


async def test_token_bitmask_restricts_each_named_request_to_its_allowed_tokens(session: Session) -> None:
    """Describe says it applies masks; a masked request samples only a token its row allows (in prefill and decode
    steps, greedy or random, whatever the logits prefer), an unmasked one in the same step is untouched."""
    if not session.describe.capabilities.token_bitmask:
        pytest.skip("executor does not advertise token_bitmask")
    vocab = session.describe.vocab_size
    free, ref = session.seq("free", 8, seed=40), session.seq("ref", 8, seed=41)
    await session.generate(ref, 4)
    hot = common_pb2.SamplingParams(temperature=1.0, seed=SEED, ignore_eos=True, max_tokens=4096)
    greedy = session.seq("greedy", 8, seed=41)  # ref's prompt: unmasked it would sample ref's tokens
    rand = Seq("rand", session.prompt(8, 42), 8, sampling=hot)
    allowed = {greedy.rid: {vocab - 1, 5}, rand.rid: set(range(100, 140))}
    finished = [session.finish(ref)]
    await session.run([(free, 8), (greedy, 8), (rand, 8)], finished_ids=finished, token_bitmasks=masks(allowed, vocab))
    for _ in range(4):
        allowed[greedy.rid] = {ref.outputs[0] + 1 if ref.outputs[0] + 1 < vocab else 3}
        await session.run([(free, 1), (greedy, 1), (rand, 1)], token_bitmasks=masks(allowed, vocab))
    assert greedy.outputs[0] in {vocab - 1, 5} and set(greedy.outputs[1:]) <= allowed[greedy.rid]
    assert set(rand.outputs) <= set(range(100, 140))
    plain = session.seq("plain", 8, seed=40)
    await session.generate(plain, 5)
    assert plain.outputs == free.outputs, "a mask of other requests changed an unmasked one"


@pytest.mark.parametrize("breakage", ["width", "bytes", "unknown id", "repeated id", "empty row", "multi-step"])
async def test_malformed_token_bitmasks_refuse_the_step_whole(session: Session, breakage: str) -> None:
    """The executor never trusts the masks: a wrong row width or byte count, an id the step does not schedule or
    names twice, a row allowing nothing, masks with num_steps > 1: the step is refused before anything runs."""
    if not session.describe.capabilities.token_bitmask:
        pytest.skip("executor does not advertise token_bitmask")
    vocab = session.describe.vocab_size
    seq = session.seq("m", 6, seed=50)
    good = masks({"m": {7}}, vocab)
    bad = executor_pb2.TokenBitmasks()
    bad.CopyFrom(good)
    num_steps = 1
    if breakage == "width":
        bad.words_per_row += 1
    elif breakage == "bytes":
        bad.bitmask = good.bitmask[:-4]
    elif breakage == "unknown id":
        bad.request_ids[:] = ["other"]
    elif breakage == "repeated id":
        bad.request_ids[:], bad.bitmask = ["m", "m"], good.bitmask * 2
    elif breakage == "empty row":
        bad.bitmask = bytes(len(good.bitmask))
    else:
        num_steps = 2
    work = session.work(seq, 6, num_steps - 1)
    result = await session.step(new_requests=[work], num_steps=num_steps, token_bitmasks=bad)
    await assert_refused_whole_and_usable(session, result, "token_bitmasks")


async def test_logit_bias_shifts_the_greedy_choice(session: Session) -> None:
    """logit_bias adds to a token's logit before sampling: +100 on a token makes a greedy request choose it (the
    simulated executor has no logits and is exempt), and a bias out of [-100, 100] is refused naming the field."""
    vocab = session.describe.vocab_size
    biased = common_pb2.SamplingParams()
    biased.CopyFrom(SAMPLING)
    biased.logit_bias[vocab - 2] = -100.0
    biased.logit_bias[vocab - 2] = 100.0
    seq = Seq("bias", session.prompt(6, 60), 6, sampling=biased)
    if session.describe.device != "simulated":
        await session.generate(seq, 3)
        assert seq.outputs == [vocab - 2] * 3
    wrong = common_pb2.SamplingParams()
    wrong.CopyFrom(SAMPLING)
    wrong.logit_bias[5] = 101.0
    bad = Seq("bad-bias", session.prompt(6, 61), 6, sampling=wrong)
    result = await session.step(new_requests=[session.work(bad, 6)])
    assert refused(result, "bad-bias") and any("sampling.logit_bias" in e.message for e in result.errors)


async def test_verified_draft_tokens_give_the_tokens_of_plain_decoding(session: Session) -> None:
    """Speculative decoding (an executor that advertises max_num_draft_tokens): drafts after a request's last token,
    right ones and a wrong one, come back as the accepted drafts and the model's token after them -- the tokens
    plain decoding gives -- and the request's computed count advances by the accepted drafts."""
    most = session.describe.capabilities.max_num_draft_tokens
    if not most:
        pytest.skip("the executor verifies no draft tokens (max_num_draft_tokens 0)")
    a, b = session.seq("a", 9, seed=11), session.seq("b", 9, seed=11)
    await session.generate(a, 14)
    await session.run([(b, len(b.tokens))])
    vocab = session.describe.vocab_size
    while len(b.outputs) < 14:
        done = len(b.outputs)
        drafts = a.outputs[done:done + min(most, 3)]
        if done % 2 and drafts:
            drafts[-1] = (drafts[-1] + 1) % vocab  # the last draft is wrong
        work = session.work(b, 1, extra_slots=len(drafts))
        assert isinstance(work, Running)
        running = columns([work])
        running.num_draft_tokens.append(len(drafts))
        running.draft_token_ids.extend(drafts)
        session.step_id += 1
        await session.call.write(executor_pb2.StepRequest(step_id=session.step_id, running=running))
        result = await asyncio.wait_for(session.call.read(), STEP_TIMEOUT_S)
        assert not result.error and not result.errors, (result.error, list(result.errors))
        got = sampled_tokens(result)["b"]
        assert 1 <= len(got) <= len(drafts) + 1 and got[:-1] == drafts[:len(got) - 1], (drafts, got)
        b.tokens += got
        b.computed = len(b.tokens) - 1
    assert b.outputs[:14] == a.outputs[:14]


async def test_a_token_bitmask_on_a_request_with_drafts_refuses_the_step_whole(session: Session) -> None:
    """A mask holds for one position, so a constrained request is sent no drafts: a step that gives one request both
    is refused whole (an executor that supports only one of the two skips this)."""
    caps = session.describe.capabilities
    if not caps.token_bitmask or not caps.max_num_draft_tokens:
        pytest.skip("the executor does not take both token masks and draft tokens")
    seq = session.seq("md", 9, seed=12)
    await session.run([(seq, len(seq.tokens))])
    work = session.work(seq, 1, extra_slots=1)
    assert isinstance(work, Running)
    running = columns([work])
    running.num_draft_tokens.append(1)
    running.draft_token_ids.append(5)
    session.step_id += 1
    step = executor_pb2.StepRequest(step_id=session.step_id, running=running,
                                    token_bitmasks=masks({"md": {5, 7}}, session.describe.vocab_size))
    await session.call.write(step)
    result = await asyncio.wait_for(session.call.read(), STEP_TIMEOUT_S)
    await assert_refused_whole_and_usable(session, result, "token_bitmasks")


async def test_token_bitmasks_may_follow_the_step_in_the_next_message(session: Session) -> None:
    """With deferred_token_bitmask, a step sent with token_bitmasks_follow takes its masks from the next message
    (same step_id, masks only): the executor may run the forward pass first; the sampled tokens obey them. A next
    message that is not the step's masks refuses the step, and the stream stays usable."""
    if not session.describe.capabilities.deferred_token_bitmask:
        pytest.skip("executor does not advertise deferred_token_bitmask")
    vocab = session.describe.vocab_size
    seq = session.seq("later", 8, seed=70)
    allowed = {seq.rid: {11, 12}}
    for n in (8, 1, 1):
        session.step_id += 1
        work = session.work(seq, n)
        new = [work] if isinstance(work, executor_pb2.NewRequest) else []
        running = [] if new else [work]
        await session.call.write(executor_pb2.StepRequest(step_id=session.step_id, new_requests=new,
                                                          running=columns(running), token_bitmasks_follow=True))
        await session.call.write(executor_pb2.StepRequest(step_id=session.step_id,
                                                          token_bitmasks=masks(allowed, vocab)))
        result = await asyncio.wait_for(session.call.read(), STEP_TIMEOUT_S)
        assert not result.error and not result.errors, result
        got = sampled_tokens(result)[seq.rid]
        assert set(got) <= allowed[seq.rid]
        seq.live, seq.computed = True, seq.computed + n
        seq.tokens += got
        seq.computed = len(seq.tokens) - 1
    other = session.seq("wrong", 6, seed=71)
    session.step_id += 1
    await session.call.write(executor_pb2.StepRequest(step_id=session.step_id, new_requests=[session.work(other, 6)],  # type: ignore[list-item]
                                                      token_bitmasks_follow=True))
    await session.call.write(executor_pb2.StepRequest(step_id=session.step_id + 5,
                                                      token_bitmasks=masks({"wrong": {3}}, vocab)))
    result = await asyncio.wait_for(session.call.read(), STEP_TIMEOUT_S)
    assert "token masks" in result.error and not sampled_tokens(result).get("wrong")
    session.finish(other)
    after = session.seq("after-follow", 6, seed=72)
    await session.step(finished_ids=["wrong"])
    await session.generate(after, 2)
    assert len(after.outputs) == 2
