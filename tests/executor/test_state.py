"""The executor's validator and request table: ownership checks, and a refused step leaves no trace."""

from __future__ import annotations

import copy

import pytest

from executor_service.state import RequestTable, StepPlan
from executor_service.validator import StepLimits, StepRefused, StepValidator
from protos.pagedserve.v1 import common_pb2, executor_pb2


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


@pytest.mark.parametrize(("field", "value", "says"), [
    ("temperature", float("nan"), "sampling.temperature: must be >= 0, got nan"),
    ("temperature", float("inf"), "sampling.temperature: must be >= 0, got inf"),
    ("top_p", -1.0, "sampling.top_p: must be in (0, 1], got -1.0"),
    ("top_k", -2, "sampling.top_k: must be -1 (off), 0 (off) or positive, got -2"),
    ("min_p", 2.0, "sampling.min_p: must be in [0, 1], got 2.0"),
    ("presence_penalty", float("nan"), "sampling.presence_penalty: must be in [-2, 2], got nan"),
    ("repetition_penalty", 0.0, "sampling.repetition_penalty: must be in (0, 2], got 0.0"),
    ("logprobs", 2**31, "sampling.logprobs: must be in [0, 20], got 2147483648"),
    ("n", 2**31, "sampling.n: must be in [1, 16], got 2147483648"),
    ("max_tokens", 0, "sampling.max_tokens: must be >= 1, got 0"),
])
def test_every_sampling_value_is_checked_against_the_contracts_range(field: str, value: float, says: str) -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4)
    bad = new("bad", [0, 1])
    setattr(bad.sampling, field, value)
    plan = apply(t, executor_pb2.StepRequest(new_requests=[bad, new("good", [2, 3])]))
    assert plan.refused == {"bad": says}
    assert set(t.states) == {"good"} and 0 not in t.device_owner


def test_sampling_values_at_their_bounds_are_accepted() -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4)
    edge = new("edge", [0, 1])
    edge.sampling.MergeFrom(common_pb2.SamplingParams(
        temperature=0.0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
        repetition_penalty=2.0, logprobs=20, n=16, max_tokens=1, seed=2**64 - 1, priority=-(2**31)))
    assert admit(t, edge) == ""


def test_num_prompt_tokens_past_the_tokens_sent_is_refused() -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4)
    lying = executor_pb2.NewRequest(request_id="x", token_ids=[5] * 4, num_prompt_tokens=5, num_scheduled_tokens=4,
                                    block_ids=[0])
    assert admit(t, lying) == "num_prompt_tokens 5 exceeds the 4 tokens sent"
    assert not t.states


def test_more_tokens_sent_than_max_model_len_is_refused() -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4, max_model_len=8)
    long = executor_pb2.NewRequest(request_id="x", token_ids=[5] * 9, num_prompt_tokens=9, num_scheduled_tokens=4,
                                   block_ids=[0])
    assert admit(t, long) == "9 tokens sent, beyond max_model_len 8"


def test_a_step_beyond_the_per_step_limits_is_refused_whole_before_anything_changes() -> None:
    t = table_with_two()
    before = snapshot(t)
    validator = StepValidator(t)  # the defaults: 2048 tokens, 256 requests, 64 lookahead slots
    flood = [new(f"r{i}", [i % 8], n=4) for i in range(5000)]  # 5,000 requests, 20,000 tokens
    with pytest.raises(StepRefused, match="the step schedules 5000 requests, more than max_num_seqs 256"):
        validator.check(executor_pb2.StepRequest(new_requests=flood))
    big = [new(f"r{i}", [], n=1024) for i in range(3)]  # 3,072 tokens in 3 requests
    with pytest.raises(StepRefused, match="the step schedules 3072 tokens, more than max_num_batched_tokens 2048"):
        validator.check(executor_pb2.StepRequest(new_requests=big))
    decodes = executor_pb2.RunningRequests(request_ids=["a", "b"], num_scheduled_tokens=[2**32 - 1, 2**32 - 1],
                                           num_new_blocks=[0, 0])
    with pytest.raises(StepRefused, match="more than max_num_batched_tokens 2048"):
        validator.check(executor_pb2.StepRequest(running=decodes))
    with pytest.raises(StepRefused, match="num_lookahead_slots 4294967295 exceeds max_num_lookahead_slots 64"):
        validator.check(executor_pb2.StepRequest(num_lookahead_slots=2**32 - 1))
    assert snapshot(t) == before


def test_a_step_at_the_per_step_limits_is_accepted() -> None:
    t = RequestTable(num_device_blocks=8, num_swap_blocks=4, block_size=4)
    validator = StepValidator(t, StepLimits(max_num_batched_tokens=12, max_num_seqs=3, max_num_lookahead_slots=2))
    plan, _ = validator.check(executor_pb2.StepRequest(new_requests=[new(x, [i], n=4) for i, x in enumerate("abc")],
                                                       num_lookahead_slots=2))
    assert not plan.refused and len(plan.admitted) == 3
    with pytest.raises(StepRefused, match="more than max_num_seqs 3"):
        validator.check(executor_pb2.StepRequest(new_requests=[new(x, [i], n=1) for i, x in enumerate("abcd")]))
