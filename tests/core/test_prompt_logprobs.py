"""Prompt logprobs in the scheduler core (#30): collected across chunks, delivered once and whole, never found in the
prefix cache while wanted, not delivered twice after a recompute; an executor that skips or leaves out positions
fails the request."""

from __future__ import annotations

from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import ExecutorResult, RequestDelta, SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import FakeClock, run_step

PROMPT = [11 + i % 7 for i in range(40)]
CHUNK = 16


def scheduler() -> Scheduler:
    cfg = CoreConfig(watermark=0.0, max_num_batched_tokens=CHUNK, enable_chunked_prefill=True)
    limits = ExecutorLimits(block_size=4, num_device_blocks=64, num_swap_blocks=0, max_model_len=512,
                            eos_token_ids=(2,))
    return Scheduler(cfg, limits, clock=FakeClock())


def request(rid: str, prompt_logprobs: int | None = 2) -> Request:
    return Request(rid, list(PROMPT), SamplingOptions(max_tokens=3, ignore_eos=True, prompt_logprobs=prompt_logprobs),
                   0.0)


def answer(out: SchedulerOutput, skip: int = 0, answers: bool = True) -> ExecutorResult:
    """As an executor: tokens where a request's tokens are all computed, and for every request that asked, the
    prompt positions its chunk yields (logprob = -position, so each is recognisable); `skip` leaves out the first
    positions of each chunk."""
    result = run_step(out)
    for work in out.scheduled:
        r = work.request
        if r.sampling.prompt_logprobs is None or not answers:
            continue
        start = r.num_computed_tokens
        last = min(start + work.num_tokens, r.num_prompt_tokens - 1)
        first = start + 1 + skip
        if first <= last:
            result.prompt_logprobs[r.request_id] = (first, [TokenLogprob(PROMPT[p], -float(p)) for p in
                                                            range(first, last + 1)])
    return result


def steps(s: Scheduler, n: int, **how: object) -> list[RequestDelta]:
    deltas: list[RequestDelta] = []
    for _ in range(n):
        out = s.schedule()
        deltas += list(s.update(out, answer(out, **how)))  # type: ignore[arg-type]
    return deltas


def delivered(deltas: list[RequestDelta], rid: str) -> list[list[TokenLogprob]]:
    return [d.prompt_logprobs for d in deltas if d.request_id == rid and d.prompt_logprobs is not None]


def test_chunks_are_collected_and_delivered_once_in_order() -> None:
    s = scheduler()
    s.add_request(request("a"))
    deltas = steps(s, 6)
    (got,) = delivered(deltas, "a")
    assert [lp.logprob for lp in got] == [-float(p) for p in range(1, len(PROMPT))]
    assert [lp.token_id for lp in got] == PROMPT[1:]
    assert sum(len(d.new_token_ids) for d in deltas if d.request_id == "a") == 3


def test_a_request_wanting_them_skips_the_prefix_cache_until_delivered() -> None:
    s = scheduler()
    s.add_request(request("plain", None))
    steps(s, 5)  # its prompt blocks are cached now
    s.add_request(request("a"))
    out = s.schedule()
    assert [n.num_computed_tokens for n in out.new_requests()] == [0], "no cache hit while it wants them"
    s.update(out, answer(out))
    assert len(delivered(steps(s, 2), "a")) == 1
    a = s.requests["a"]
    assert not a.wants_prompt_logprobs and s.kv.get_computed_blocks(a).num_tokens > 0, \
        "once delivered, a recompute of it may use the cache again"


def test_a_recompute_mid_prompt_delivers_each_position_once() -> None:
    s = scheduler()
    s.add_request(request("a"))
    first = steps(s, 1)
    assert delivered(first, "a") == []
    s.reset_executor()  # the executor is lost after one chunk: the prompt is computed again from position 0
    deltas = steps(s, 6)
    (got,) = delivered(deltas, "a")
    assert [lp.logprob for lp in got] == [-float(p) for p in range(1, len(PROMPT))]


def test_an_executor_that_skips_positions_fails_the_request() -> None:
    s = scheduler()
    s.add_request(request("a"))
    deltas = steps(s, 2, skip=1)
    (end,) = [d for d in deltas if d.finish_reason is not None]
    assert end.finish_reason is FinishReason.ERROR and "skipped prompt positions" in end.error


def test_an_executor_that_never_answers_fails_the_request_when_the_prompt_is_done() -> None:
    s = scheduler()
    s.add_request(request("a"))
    deltas = steps(s, 4, answers=False)
    (end,) = [d for d in deltas if d.finish_reason is not None]
    assert end.finish_reason is FinishReason.ERROR and "0 of the prompt's 39 positions" in end.error
    assert not any(d.new_token_ids for d in deltas)
