from __future__ import annotations

import functools

import pytest

from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult
from scheduler_service.core.request import FinishReason, RequestStatus
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import FakeClock, make_request, run_step

EOS = 2


def make_scheduler(num_blocks: int = 64, cpu_blocks: int = 0, max_model_len: int = 4096,
                   **config: object) -> Scheduler:
    cfg = CoreConfig(watermark=0.0, **config)  # type: ignore[arg-type]
    limits = ExecutorLimits(block_size=16, num_device_blocks=num_blocks, num_swap_blocks=cpu_blocks,
                         max_model_len=max_model_len, eos_token_ids=(EOS,))
    return Scheduler(cfg, limits, clock=FakeClock())


def table_sizes(s: Scheduler) -> dict[str, int]:
    return {r.request_id: len(s.kv.block_table(r.request_id)) for r in s.running}


def test_seed_worked_example() -> None:
    s = make_scheduler(num_blocks=56)
    for rid, n in [("A", 100), ("B", 200), ("C", 50)]:
        s.add_request(make_request(rid, n, max_tokens=50))
    out1 = s.schedule()
    assert [w.request.request_id for w in out1.scheduled] == ["A", "B", "C"]
    assert table_sizes(s) == {"A": 7, "B": 13, "C": 4}
    s.update(out1, run_step(out1))

    s.add_request(make_request("D", 300, max_tokens=50))
    s.add_request(make_request("E", 80, max_tokens=50))
    out2 = s.schedule()
    assert {w.request.request_id: w.num_tokens for w in out2.scheduled} == {
        "A": 1, "B": 1, "C": 1, "D": 300, "E": 80}
    assert table_sizes(s) == {"A": 7, "B": 13, "C": 4, "D": 19, "E": 5}
    s.update(out2, run_step(out2))

    s.add_request(make_request("F", 150, max_tokens=50))
    out3 = s.schedule()
    assert "F" not in {w.request.request_id for w in out3.scheduled}
    assert s.kv.device.num_free < 10
    deltas = s.update(out3, run_step(out3, lambda rid, pos: EOS if rid == "C" else 50))
    c = next(d for d in deltas if d.request_id == "C")
    assert c.finish_reason is FinishReason.STOPPED
    assert s.kv.device.num_free >= 10

    out4 = s.schedule()
    assert out4.finished_ids == ["C"]
    new = out4.new_requests()
    assert [n.request_id for n in new] == ["F"]
    assert len(new[0].block_ids) == 10
    assert {r.request_id for r in s.running} == {"A", "B", "D", "E", "F"}


def test_length_stop_and_min_tokens() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=3, min_tokens=2))
    finished = None
    steps = 0
    while finished is None:
        out = s.schedule()
        deltas = s.update(out, run_step(out, lambda rid, pos: EOS))
        finished = next((d.finish_reason for d in deltas if d.finish_reason), None)
        steps += 1
    assert finished is FinishReason.STOPPED
    assert steps == 2
    assert s.kv.device.num_free == 64


def test_ignore_eos_and_stop_token_ids() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 5, max_tokens=4, ignore_eos=True))
    s.add_request(make_request("b", 5, max_tokens=4, stop_token_ids=(9,)))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    reasons = {}
    while s.has_unfinished():
        out = s.schedule()
        for d in s.update(out, run_step(out, lambda rid, pos: EOS if rid == "a" else 9)):
            tokens[d.request_id] += d.new_token_ids
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
    assert tokens == {"a": [EOS] * 4, "b": [9]}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.STOPPED}


def test_a_stop_token_as_the_last_allowed_token_is_a_stop() -> None:
    """vLLM's order: EOS and stop tokens before the length limits, max_tokens and max_model_len alike."""
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("tokens", 3, max_tokens=2, stop_token_ids=(9,)))
    s.add_request(make_request("model_len", 5, max_tokens=3))
    reasons = {}
    while s.has_unfinished():
        out = s.schedule()
        for d in s.update(out, run_step(out, lambda rid, pos: 9 if rid == "tokens" and pos == 4 else
                                        EOS if rid == "model_len" and pos == 7 else 50)):
            if d.finish_reason:
                reasons[d.request_id] = d.finish_reason
    assert reasons == {"tokens": FinishReason.STOPPED, "model_len": FinishReason.STOPPED}


def test_max_model_len_stops() -> None:
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("a", 5, max_tokens=100))
    n = 0
    while s.has_unfinished():
        out = s.schedule()
        for d in s.update(out, run_step(out)):
            n += len(d.new_token_ids)
            last = d.finish_reason
    assert n == 3 and last is FinishReason.LENGTH


@pytest.mark.parametrize("path", ["columns", "per-request"])
@pytest.mark.parametrize("limit", ["max_tokens", "max_model_len"])
@pytest.mark.parametrize("stop", ["eos", "stop_token"])
def test_a_stop_token_at_the_last_allowed_position_finishes_stop_not_length(path: str, limit: str, stop: str) -> None:
    """vLLM's order (#27): min_tokens, then EOS, then stop tokens, then length. A request that samples EOS or
    one of its stop tokens as its last allowed token (max_tokens reached, or max_model_len) stops with
    `stop`; the same request sampling any other token there ends with `length`."""
    def choose(last: int, rid: str, pos: int) -> int:
        return last if pos == 7 else 50

    for token, reason in ((EOS if stop == "eos" else 9, FinishReason.STOPPED), (50, FinishReason.LENGTH)):
        s = make_scheduler(max_model_len=8 if limit == "max_model_len" else 4096)
        s.add_request(make_request("a", 5, max_tokens=3 if limit == "max_tokens" else 100,
                                   stop_token_ids=(9,) if stop == "stop_token" else ()))
        tokens: list[int] = []
        last = None
        while s.has_unfinished():
            out = s.schedule()
            result = run_step(out, functools.partial(choose, token))
            if path == "per-request":
                result.logprobs = {w.request.request_id: [] for w in out.scheduled}
            for d in s.update(out, result):
                tokens += d.new_token_ids
                last = d.finish_reason
        assert (tokens, last) == ([50, 50, token], reason)


def test_min_tokens_holds_a_stop_token_but_not_max_model_len() -> None:
    """min_tokens holds EOS back, never the model's length: a request whose min_tokens reach past
    max_model_len ends there with `length`, even on an EOS."""
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("a", 5, max_tokens=10, min_tokens=6))
    tokens: list[int] = []
    while s.has_unfinished():
        out = s.schedule()
        for d in s.update(out, run_step(out, lambda rid, pos: EOS)):
            tokens += d.new_token_ids
            last = d.finish_reason
    assert (tokens, last) == ([EOS] * 3, FinishReason.LENGTH)


def test_budgets_respected() -> None:
    s = make_scheduler(num_blocks=1000, max_num_seqs=3, max_num_batched_tokens=100)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 40, max_tokens=5))
    out = s.schedule()
    assert len(out.scheduled) == 3
    assert out.total_num_scheduled_tokens <= 100
    assert [w.num_tokens for w in out.scheduled] == [40, 40, 20]


def test_abort_frees_blocks_and_tells_executor() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40))
    out = s.schedule()
    s.update(out, run_step(out))
    assert s.abort("a")
    assert s.kv.device.num_used == len(s.kv.block_table("b"))
    assert s.schedule().finished_ids == ["a"]
    assert not s.abort("missing")


def test_abort_while_waiting_and_while_step_in_flight() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    out = s.schedule()
    s.abort("b")
    assert len(s.waiting) == 0
    s.abort("a")
    assert list(s.update(out, run_step(out))) == []
    assert s.kv.device.num_used == 0 and not s.has_unfinished()


def test_executor_error_fails_only_named_request() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    out = s.schedule()
    result = run_step(out)
    result.errors["a"] = "boom"
    deltas = {d.request_id: d for d in s.update(out, result)}
    assert deltas["a"].finish_reason is FinishReason.ERROR and deltas["a"].error == "boom"
    assert deltas["b"].finish_reason is None and len(deltas["b"].new_token_ids) == 1
    assert s.requests.keys() == {"b"}


def test_never_fits_finishes_with_error_and_queue_proceeds() -> None:
    s = make_scheduler(num_blocks=8)
    s.add_request(make_request("huge", 200))
    s.add_request(make_request("small", 10))
    out = s.schedule()
    assert [d.request_id for d in out.rejected] == ["huge"]
    assert "10 blocks" in out.rejected[0].error or "13 KV blocks" in out.rejected[0].error
    assert "8 blocks" in out.rejected[0].error
    assert [w.request.request_id for w in out.scheduled] == ["small"]
    deltas = s.update(out, run_step(out))
    assert deltas[0].finish_reason is FinishReason.ERROR


def test_prompt_beyond_max_model_len_is_rejected() -> None:
    s = make_scheduler(max_model_len=32)
    s.add_request(make_request("a", 40))
    out = s.schedule()
    assert out.rejected and "max_model_len is 32" in out.rejected[0].error


def test_duplicate_request_id_raises() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", 4))


def test_finished_request_blocks_admit_next_in_very_next_schedule() -> None:
    s = make_scheduler(num_blocks=4)
    s.add_request(make_request("a", 48, max_tokens=1))
    s.add_request(make_request("b", 48, max_tokens=1))
    out = s.schedule()
    assert [w.request.request_id for w in out.scheduled] == ["a"]
    s.update(out, run_step(out))
    out = s.schedule()
    assert [w.request.request_id for w in out.scheduled] == ["b"]


def test_missing_token_for_completed_step_is_an_error() -> None:
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    out = s.schedule()
    deltas = s.update(out, ExecutorResult())
    assert deltas[0].finish_reason is FinishReason.ERROR
    assert s.requests == {} and s.kv.device.num_used == 0


def test_status_transitions() -> None:
    s = make_scheduler()
    r = make_request("a", 4, max_tokens=1)
    s.add_request(r)
    assert r.status is RequestStatus.WAITING
    out = s.schedule()
    assert r.status is RequestStatus.RUNNING
    s.update(out, run_step(out))
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH


def test_a_token_for_a_request_gone_from_its_row_is_dropped_when_a_new_request_took_the_row() -> None:
    s = make_scheduler(max_num_seqs=1, async_scheduling=True)
    s.add_request(make_request("a", 4, max_tokens=8))
    first = s.schedule()
    s.update(first, run_step(first))
    decode = s.schedule()
    assert decode.plain is not None and decode.plain.ids == ["a"], "a steady decode is a plain row"
    slot = s.running[0].slot
    s.abort("a")
    s.add_request(make_request("b", 4, max_tokens=8))
    admit = s.schedule()
    b = s.requests["b"]
    assert b.slot == slot, "the new request takes the freed row"
    assert list(s.update(decode, run_step(decode))) == [], "a's token reaches nobody"
    assert b.output_token_ids == [] and s.rs.num_tokens[slot] == b.num_tokens == 4
    deltas = list(s.update(admit, run_step(admit)))
    assert [(d.request_id, len(d.new_token_ids)) for d in deltas] == [("b", 1)]
    assert s.rs.num_tokens[slot] == 5 and b.num_computed_tokens == 4


def test_plain_decodes_come_back_as_columns_whatever_order_the_executor_answers_in() -> None:
    s = make_scheduler()
    for rid in "abc":
        s.add_request(make_request(rid, 3))
    out = s.schedule()
    s.update(out, run_step(out))
    out = s.schedule()
    assert out.plain is not None and out.plain.ids == ["a", "b", "c"]
    for ids in (["a", "b", "c"], ["c", "a", "b"]):
        tokens = {"a": 11, "b": 12, "c": 13}
        deltas = s.update(out, ExecutorResult(ids=ids, tokens=[tokens[rid] for rid in ids]))
        assert deltas.ids == ["a", "b", "c"] and deltas.tokens == [11, 12, 13] and not deltas.others
        assert [(d.request_id, d.new_token_ids) for d in deltas] == [("a", [11]), ("b", [12]), ("c", [13])]
        assert [r.output_token_ids[-1] for r in s.running] == [11, 12, 13]
        out = s.schedule()
