"""Deterministic cases for the running set's columnar hot path (review of #13): plain decodes chosen as
a mask, grown, unchosen by preemption or the budget, and updated as columns."""

from __future__ import annotations

from scheduler_service.core.config import CoreConfig, ExecutorLimits, PreemptionMode, Victim
from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import check_columns
from tests.support.model_executor import ModelExecutor, token_at

BS = 4


class Run:
    def __init__(self, num_blocks: int, cpu_blocks: int = 0, max_model_len: int = 96, **config: object) -> None:
        cfg = CoreConfig(watermark=0.0, **config)  # type: ignore[arg-type]
        self.s = Scheduler(cfg, ExecutorLimits(BS, num_blocks, cpu_blocks, max_model_len=max_model_len))
        self.ex = ModelExecutor(num_blocks, max(cpu_blocks, 1), BS)
        self.tokens: dict[str, list[int]] = {}

    def add(self, rid: str, prompt_len: int, **sampling: object) -> Request:
        options = SamplingOptions(**{"max_tokens": 50, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
        request = Request(rid, [10 + len(self.tokens)] * prompt_len, options, 0.0)
        self.tokens[rid] = []
        self.s.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.s.schedule()
        check_columns(self.s)
        for d in self.s.update(out, self.ex.step(out)):
            self.tokens[d.request_id] += d.new_token_ids
        check_columns(self.s)
        return out


def test_preempting_a_plain_decode_later_in_the_running_order_gives_back_no_token_it_never_took() -> None:
    # Running order A, B, C: A fills its block with the pool empty and preempts B (the longest), a plain
    # decode the walk has not charged yet; C, a chunked prefill after B, must not get B's token on top.
    run = Run(7, max_num_seqs=8, max_num_batched_tokens=4, preemption_mode=PreemptionMode.RECOMPUTE,
              preemption_victim=Victim.LONGEST, enable_prefix_caching=False)
    run.add("A", 3)
    run.add("B", 9)
    sent = []
    for step in range(8):
        if step == 4:
            run.add("C", 8)
        sent.append(run.step())
    preempting = next(out for out in sent if out.num_preempted)
    assert [(w.request.request_id, w.num_tokens) for w in preempting.scheduled] == [("A", 1), ("C", 3)]
    assert all(out.total_num_scheduled_tokens <= 4 for out in sent)


def test_a_plain_decode_answered_with_no_token_fails_alone_while_its_neighbour_keeps_its_own_tokens() -> None:
    # Token lists (as a multi-token answer or a hand-built result carries them): "a" sampled nothing and
    # "b" two tokens; the two lists must not be read as one token each.
    run = Run(16, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = run.add("a", 3), run.add("b", 3)
    run.step()
    out = run.s.schedule()
    assert out.plain is not None and [w.request.request_id for w in out.plain.works] == ["a", "b"]
    deltas = {d.request_id: d for d in run.s.update(out, ExecutorResult(sampled={"a": [], "b": [41, 42]}))}
    assert deltas["a"].finish_reason is FinishReason.ERROR and a.is_finished
    assert deltas["b"].new_token_ids[0] == 41 and b.output_token_ids[1] == 41
    check_columns(run.s)


def finish(run: Run, steps: int = 200) -> None:
    for _ in range(steps):
        if not run.s.has_unfinished():
            return
        run.step()
    raise AssertionError(f"unfinished: {list(run.s.requests)}")


def expected(rid: str, prompt_len: int, max_tokens: int) -> list[int]:
    return [token_at(rid, prompt_len + i) for i in range(max_tokens)]


def test_a_plain_decode_grown_this_step_and_then_swapped_out_gives_its_new_block_back_first() -> None:
    # B (longest) and A both fill their blocks; the pool has one block: B, first in order, takes it,
    # A preempts B, whose swap-out must carry its 3 written blocks, not the empty one it just grew.
    run = Run(5, cpu_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, preemption_mode=PreemptionMode.SWAP,
              preemption_victim=Victim.LONGEST, enable_prefix_caching=False)
    b, a = run.add("B", 11, max_tokens=6), run.add("A", 3, max_tokens=6)
    run.step()
    run.step()
    assert run.s.kv.device.num_free == 1
    out = run.step()
    assert out.swapped_out_ids == ["B"] and len(out.swap_out) == 3
    assert [(w.request.request_id, len(w.new_block_ids)) for w in out.scheduled] == [("A", 1)]
    assert run.s.kv.device.num_free == 5 - 2
    finish(run)
    assert run.tokens == {"B": expected("B", 11, 6), "A": expected("A", 3, 6)}
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert run.s.kv.device.num_free == 5 and run.s.kv.cpu.num_free == 8


def test_the_budget_cut_in_a_run_of_growing_plain_decodes_gives_the_unscheduled_ones_blocks_back() -> None:
    run = Run(16, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=False)
    for rid in "abcd":
        run.add(rid, 3, max_tokens=8)
    run.step()
    run.step()
    run.s.config.max_num_batched_tokens = 2
    out = run.step()  # all four fill their block; two fit the budget
    assert [(w.request.request_id, len(w.new_block_ids)) for w in out.scheduled] == [("a", 1), ("b", 1)]
    assert [len(run.s.kv.block_table(rid)) for rid in "abcd"] == [2, 2, 1, 1]
    assert run.s.kv.device.num_free == 16 - 6
    run.s.config.max_num_batched_tokens = 16
    finish(run)
    assert run.tokens == {rid: expected(rid, 3, 8) for rid in "abcd"}


def test_a_grown_plain_decode_aborted_before_its_update_frees_every_block_and_its_token_is_dropped() -> None:
    run = Run(8, max_num_seqs=4, max_num_batched_tokens=16)
    run.add("a", 4, max_tokens=8)
    b = run.add("b", 3, max_tokens=8)
    run.step()
    out = run.s.schedule()  # "a" fills its block (4 tokens + 1): it grows
    assert [(w.request.request_id, len(w.new_block_ids)) for w in out.scheduled] == [("a", 1), ("b", 0)]
    result = run.ex.step(out)
    run.s.abort("a")  # while the executor runs the step
    assert run.s.kv.device.num_free == 8 - 1
    assert [d.request_id for d in run.s.update(out, result)] == ["b"]
    check_columns(run.s)
    assert run.s.schedule().finished_ids == ["a"] and len(b.output_token_ids) == 2


def test_a_decode_that_would_outgrow_the_usable_pool_finishes_with_an_error_there_in_sync_and_async_mode() -> None:
    # 8 blocks, a watermark of 2: no request may hold more than 6 (24 slots), as admission already
    # rules. A plain decode (or one scheduled ahead of its step in flight) must not grow into the
    # watermark: it finishes with the error the per-request path gives, at the same token.
    for async_scheduling in (False, True):
        cfg = CoreConfig(watermark=0.25, async_scheduling=async_scheduling)
        s = Scheduler(cfg, ExecutorLimits(BS, 8, 0, max_model_len=96))
        ex = ModelExecutor(8, 1, BS)
        request = Request("r", [5] * 20, SamplingOptions(max_tokens=30, ignore_eos=True), 0.0)
        s.add_request(request)
        pending: list[tuple[SchedulerOutput, ExecutorResult]] = []
        deltas = []
        for _ in range(40):
            out = s.schedule()
            check_columns(s)
            pending.append((out, ex.step(out)))
            if len(pending) > async_scheduling or not s.has_unfinished():
                deltas += [d for late in pending for d in s.update(*late)]
                pending.clear()
                check_columns(s)
            if not s.has_unfinished() and not pending:
                break
        assert deltas[-1].finish_reason is FinishReason.ERROR, async_scheduling
        assert "grew to 25 tokens (7 KV blocks of 4)" in deltas[-1].error and "at most 6 blocks" in deltas[-1].error
        assert sum(len(d.new_token_ids) for d in deltas) == 24 - 20 + 1
        assert s.kv.device.num_free == 8


def test_more_running_requests_than_the_first_columns_hold_grow_them_and_keep_every_row() -> None:
    run = Run(600, max_num_seqs=256, max_num_batched_tokens=4096)
    for i in range(150):
        run.add(f"r{i}", 3 + i % 7, max_tokens=2 + i % 5)
    first = run.step()
    assert len(first.scheduled) == 150 and len(run.s.rs.num_tokens) >= 150
    for i in range(150, 220):  # new requests take the rows the finished ones left
        run.add(f"r{i}", 2, max_tokens=3)
    finish(run)
    assert all(run.tokens[f"r{i}"] == expected(f"r{i}", 3 + i % 7, 2 + i % 5) for i in range(150))
    assert all(run.tokens[f"r{i}"] == expected(f"r{i}", 2, 3) for i in range(150, 220))


def test_a_prompt_whose_last_token_is_computed_as_a_plain_decode_registers_its_last_block_at_once() -> None:
    # An 8-token prompt in chunks of 7 and 1: the 1-token chunk is a plain decode, and the prompt's
    # second full block must be found by a look-up while the request still runs, as after any prefill.
    run = Run(32, max_num_batched_tokens=7)
    prompt = list(range(20, 28))
    request = Request("a", list(prompt), SamplingOptions(max_tokens=10, ignore_eos=True), 0.0)
    run.tokens["a"] = []
    run.s.add_request(request)
    run.step()
    plain = run.step().plain
    assert plain is not None and plain.ids == ["a"]
    probe = Request("probe", [*prompt, 1, 2, 3, 4], SamplingOptions(), 0.0)
    assert run.s.cached_prefix_tokens(probe) == 8
    run.add("b", 3)  # a plain decode's first token through the columns keeps its row right
    finish(run)
    assert run.tokens["a"] == expected("a", 8, 10)
