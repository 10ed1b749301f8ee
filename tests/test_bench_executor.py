"""benchmarks/executor.py sends a batch's prompts within the executor's max_num_batched_tokens (a batch of 256 x 32
tokens in one step was refused on an H200): every prompt once, whole, with its own blocks."""

from __future__ import annotations

from benchmarks.executor import prefill_steps


def test_prompts_are_split_into_steps_within_the_budget() -> None:
    batch = [list(range(n)) for n in (30, 30, 30, 5, 64, 1)]
    steps, tables, next_block = prefill_steps(batch, block_size=16, budget=64)
    scheduled = [sum(r.num_scheduled_tokens for r in step.new_requests) for step in steps]
    assert scheduled == [60, 35, 64, 1]
    assert [r.request_id for step in steps for r in step.new_requests] == ["0", "1", "2", "3", "4", "5"]
    assert [len(t) for t in tables] == [2, 2, 2, 1, 4, 1]
    assert sorted(b for t in tables for b in t) == list(range(next_block)) and next_block == 12


def test_a_batch_within_the_budget_is_one_step() -> None:
    steps, _, _ = prefill_steps([[1] * 32] * 64, block_size=16, budget=2048)
    assert len(steps) == 1 and len(steps[0].new_requests) == 64
