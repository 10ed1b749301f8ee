"""The executor's validator and request table: ownership checks, and a refused step leaves no trace."""

from __future__ import annotations

import copy

import pytest

from executor_service.state import RequestTable, StepPlan
from executor_service.validator import StepRefused, StepValidator
from protos.pagedserve.v1 import executor_pb2


def new(rid: str, blocks: list[int], n: int = 8) -> executor_pb2.NewRequest:
    return executor_pb2.NewRequest(request_id=rid, token_ids=[5] * n, num_prompt_tokens=n,
                                   num_scheduled_tokens=n, block_ids=blocks)


def running(rid: str, blocks: list[int], n: int, resumed: bool) -> executor_pb2.StepRequest:
    return executor_pb2.StepRequest(running=executor_pb2.RunningRequests(
        request_ids=[rid], num_scheduled_tokens=[n], num_new_blocks=[len(blocks)], new_block_ids=blocks,
        resumed=[resumed]))


def apply(t: RequestTable, step: executor_pb2.StepRequest) -> StepPlan:
    plan, _ = StepValidator(t).check(step)
    t.commit(plan)
    return plan


def admit(t: RequestTable, *requests: executor_pb2.NewRequest) -> str:
    """The refusal messages of new requests, joined ("" when all were admitted)."""
    return "; ".join(apply(t, executor_pb2.StepRequest(new_requests=requests)).refused.values())


def table_with_two() -> RequestTable:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4)
    assert admit(t, new("a", [0, 1])) == ""
    assert admit(t, new("b", [2, 3])) == ""
    return t


def snapshot(t: RequestTable) -> tuple[object, ...]:
    return copy.deepcopy((t.device_owner, t.swap_owner, {k: v.block_table for k, v in t.states.items()}))


def test_a_refused_step_changes_nothing() -> None:
    t = table_with_two()
    before = snapshot(t)
    step = executor_pb2.StepRequest(
        swapped_out_ids=["a"], swap_out=[executor_pb2.BlockMapping(src=0, dst=0),
                                         executor_pb2.BlockMapping(src=1, dst=1)],
        copy=[executor_pb2.BlockMapping(src=2, dst=3)])
    with pytest.raises(StepRefused, match="held by live request 'b'"):
        apply(t, step)
    assert snapshot(t) == before


def test_swap_out_then_in_moves_ownership() -> None:
    t = table_with_two()
    apply(t, executor_pb2.StepRequest(swapped_out_ids=["a"], swap_out=[
        executor_pb2.BlockMapping(src=0, dst=2), executor_pb2.BlockMapping(src=1, dst=3)]))
    assert t.states["a"].block_table is None and t.swap_owner == {2: "a", 3: "a"}
    assert admit(t, new("c", [0, 1])) == ""
    t.drop("c")
    apply(t, executor_pb2.StepRequest(swap_in=[
        executor_pb2.BlockMapping(src=2, dst=5), executor_pb2.BlockMapping(src=3, dst=6)]))
    assert t.swap_owner == {}
    assert not apply(t, running("a", [5, 6], 8, resumed=True)).refused
    assert t.states["a"].block_table == [5, 6]


def test_blocks_of_a_swapped_out_request_may_be_reused_in_the_same_step() -> None:
    t = table_with_two()
    apply(t, executor_pb2.StepRequest(swapped_out_ids=["a"], swap_out=[
        executor_pb2.BlockMapping(src=0, dst=0), executor_pb2.BlockMapping(src=1, dst=1)],
        copy=[executor_pb2.BlockMapping(src=2, dst=0)]))
    assert t.swap_owner == {0: "a", 1: "a"}


@pytest.mark.parametrize("blocks,error", [([8], "out of range"), ([4, 4], "repeat")])
def test_bad_blocks_for_a_new_request(blocks: list[int], error: str) -> None:
    t = table_with_two()
    assert error in admit(t, new("c", blocks))
    assert "c" not in t.states and t.device_owner == {0: {"a"}, 1: {"a"}, 2: {"b"}, 3: {"b"}}


@pytest.mark.parametrize("kind", ["swap_in", "copy"])
@pytest.mark.parametrize("dst", [8, 9, 2**32 - 1])  # the pool has 8 device blocks: 8 is the first past it
def test_a_swap_in_or_copy_destination_past_the_device_pool_refuses_the_step(kind: str, dst: int) -> None:
    t = table_with_two()
    apply(t, executor_pb2.StepRequest(swapped_out_ids=["a"], swap_out=[
        executor_pb2.BlockMapping(src=0, dst=0), executor_pb2.BlockMapping(src=1, dst=1)]))
    before = snapshot(t)

    def step(dst: int) -> executor_pb2.StepRequest:
        if kind == "swap_in":  # swap block 0 holds a's first block
            return executor_pb2.StepRequest(swap_in=[executor_pb2.BlockMapping(src=0, dst=dst)])
        return executor_pb2.StepRequest(copy=[executor_pb2.BlockMapping(src=2, dst=dst)])  # 2: b's block

    with pytest.raises(StepRefused, match=f"{kind} destination block id {dst} out of range \\[0, 8\\)"):
        apply(t, step(dst))
    assert snapshot(t) == before
    assert not apply(t, step(7)).refused  # the last block of the pool is a destination like any other


def test_requests_share_prefix_blocks_and_a_shared_block_stays_until_its_last_holder_goes() -> None:
    t = table_with_two()
    assert admit(t, new("c", [0, 4])) == ""  # block 0: a's cached prefix
    apply(t, executor_pb2.StepRequest(swapped_out_ids=["a", "c"], swap_out=[
        executor_pb2.BlockMapping(src=0, dst=0), executor_pb2.BlockMapping(src=1, dst=1),
        executor_pb2.BlockMapping(src=0, dst=2), executor_pb2.BlockMapping(src=4, dst=3)]))
    assert t.swap_owner == {0: "a", 1: "a", 2: "c", 3: "c"} and 0 not in t.device_owner
    assert admit(t, new("d", [0, 5])) == "" and admit(t, new("e", [0, 6])) == ""
    with pytest.raises(StepRefused, match="held by live request 'd'"):
        apply(t, executor_pb2.StepRequest(copy=[executor_pb2.BlockMapping(src=2, dst=0)]))
    t.drop("d")
    assert t.device_owner[0] == {"e"}
    t.drop("e")
    assert 0 not in t.device_owner


def test_resuming_a_request_that_was_not_swapped_releases_its_old_blocks() -> None:
    t = table_with_two()
    assert not apply(t, running("a", [4, 5], 8, resumed=True)).refused
    t.drop("a")
    assert admit(t, new("c", [0, 1, 4, 5], n=16)) == ""


def test_a_request_cannot_claim_its_own_block_again() -> None:
    t = table_with_two()
    assert "already in this request's table" in apply(t, running("a", [1], 8, resumed=False)).refused["a"]


def test_two_writes_to_one_destination_are_refused_before_anything_changes() -> None:
    t = table_with_two()
    before = snapshot(t)
    twice = [executor_pb2.BlockMapping(src=0, dst=6), executor_pb2.BlockMapping(src=1, dst=6)]
    step = executor_pb2.StepRequest(copy=twice)
    with pytest.raises(StepRefused, match="more than one"):
        apply(t, step)
    assert snapshot(t) == before


def test_vocabulary_and_max_model_len_are_checked_per_request() -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4, vocab_size=100, max_model_len=8)
    bad = executor_pb2.NewRequest(request_id="x", token_ids=[5, 100], num_prompt_tokens=2, num_scheduled_tokens=2,
                                  block_ids=[0])
    assert "outside the vocabulary" in admit(t, bad)
    assert admit(t, new("a", [0, 1], n=8)) == ""
    state = t.states["a"]
    state.token_ids.append(7)
    state.num_computed = 8
    validator = StepValidator(t)
    assert "beyond max_model_len 8" in validator.check(running("a", [2], 1, resumed=False))[0].refused["a"]
    assert "at least 1" in validator.check(running("a", [], 0, resumed=False))[0].refused["a"]
