"""The stop rules exist once (scheduler_service/core/stop_rules.py, #26): a rule added to the table
STOP_RULES alone is obeyed by the per-request path (update() through _update_one) and by the vectorised
update of the plain decodes (their running-set columns, derived from the table), one toy rule of each
kind (LengthRule, TokenRule, RequestTokenRule, a general StopRule). The scheduler is driven three ways:
with the model executor's answers (the plain decodes take the vectorised update), with logprobs in
every answer (every work takes _update_one), and with async scheduling (nothing is scheduled ahead past
a length limit). Were either path to ignore the table, a request would run past the toy rule's stop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from scheduler_service.core import stop_rules
from scheduler_service.core.config import CoreConfig, ExecutorLimits
from scheduler_service.core.outputs import ExecutorResult, RequestDelta, ScheduledWork, SchedulerOutput
from scheduler_service.core.request import FinishReason, Request, SamplingOptions
from scheduler_service.core.running import RunningSet
from scheduler_service.core.scheduler import Scheduler
from scheduler_service.core.stop_rules import (
    STOP_RULES,
    LengthRule,
    RequestTokenRule,
    StopRule,
    StopTable,
    TokenRule,
    stop_reason,
)
from tests.support.core_helpers import check_columns
from tests.support.model_executor import ModelExecutor, token_at

BS = 4
EOS = 2  # the model executor never samples it (its tokens are 3..52): its column stays beside the toy's
MAX_TOKENS = 24
MAX_MODEL_LEN = 96
X = 17  # the toy token rule's token


@dataclass(frozen=True, eq=False)
class StopAtTokenAfter(TokenRule):
    """Stop at token `token` once `after` tokens are out (every request listens; fires() narrows)."""

    token: int = X
    after: int = 2

    def tokens(self, limits: ExecutorLimits) -> tuple[int, ...]:
        return (self.token,)

    def fires(self, sampling: SamplingOptions, token: int, num_output: int, num_tokens: int) -> bool:
        return num_output >= self.after


class PriorityCap(LengthRule):
    """A request of priority p > 0 has at most 4 p output tokens."""

    def length(self, sampling: SamplingOptions, num_prompt: int, limits: ExecutorLimits) -> int:
        return num_prompt + 4 * sampling.priority if sampling.priority else limits.max_model_len


class PriorityToken(RequestTokenRule):
    """A request of priority p stops at token 10 p + 7 (its own id: its rows are watched)."""

    def tokens_of(self, sampling: SamplingOptions) -> tuple[int, ...]:
        return (10 * sampling.priority + 7,)


class OddPriorityMultipleOfNine(StopRule):
    """A request of odd priority stops at a token divisible by 9 once 3 tokens are out (a rule of the
    general kind: its rows are watched)."""

    def fires(self, sampling: SamplingOptions, token: int, num_output: int, num_tokens: int) -> bool:
        return sampling.priority % 2 == 1 and token % 9 == 0 and num_output >= 3

    def watched(self, sampling: SamplingOptions) -> bool:
        return sampling.priority % 2 == 1


# Each toy rule, and when it ends a request (sampling, the token, num_output): the test's own oracle.
Oracle = Callable[[SamplingOptions, int, int], bool]
TOYS: dict[str, tuple[StopRule, FinishReason, Oracle]] = {
    "token": (StopAtTokenAfter(), FinishReason.STOPPED, lambda o, token, n: token == X and n >= 2),
    "length": (PriorityCap(), FinishReason.LENGTH, lambda o, token, n: o.priority > 0 and n >= 4 * o.priority),
    "request-token": (PriorityToken(), FinishReason.STOPPED, lambda o, token, n: token == 10 * o.priority + 7),
    "general": (OddPriorityMultipleOfNine(), FinishReason.STOPPED,
                lambda o, token, n: o.priority % 2 == 1 and token % 9 == 0 and n >= 3),
}


def requests() -> list[Request]:
    """Twelve requests: ignore_eos or not, some watched (a stop token the model never samples), others
    plain decodes that only their derived columns can stop; priorities 0..3."""
    out = []
    for i in range(12):
        options = SamplingOptions(max_tokens=MAX_TOKENS, ignore_eos=i % 2 == 0, priority=i % 4,
                                  stop_token_ids=(1,) if i % 3 == 0 else ())
        out.append(Request(f"q{i}", [20 + i] * (3 + i % 6), options, 0.0))
    return out


def expected(request: Request, oracle: Oracle, reason: FinishReason) -> tuple[list[int], FinishReason]:
    """The tokens and reason that max_tokens (the only built-in rule these requests meet) and then the toy
    rule give, the model sampling token_at."""
    tokens: list[int] = []
    while True:
        token = token_at(request.request_id, request.num_prompt_tokens + len(tokens))
        tokens.append(token)
        if len(tokens) >= request.sampling.max_tokens:
            return tokens, FinishReason.LENGTH
        if oracle(request.sampling, token, len(tokens)):
            return tokens, reason


@dataclass
class Finished:
    tokens: list[int]
    reason: FinishReason
    per_request: bool  # its last step was updated through _update_one, not the plain decodes' columns
    sampled: int  # the tokens the executor sampled for it


MODES = ["columns", "per-request", "async"]


def drive(monkeypatch: pytest.MonkeyPatch, mode: str) -> dict[str, Finished]:
    """Run the requests to the end. "columns": the model executor's answers, in which the plain decodes
    take the vectorised update; "per-request": every answer carries logprobs, so every work takes
    _update_one; "async": as "columns", with each step scheduled while the one before is in flight."""
    per_request: set[str] = set()
    update_one = Scheduler._update_one

    def spy(self: Scheduler, work: ScheduledWork, result: ExecutorResult, others: list[RequestDelta]) -> None:
        per_request.add(work.request.request_id)
        update_one(self, work, result, others)

    monkeypatch.setattr(Scheduler, "_update_one", spy)
    s = Scheduler(CoreConfig(watermark=0.0, max_num_seqs=16, max_num_batched_tokens=32,
                             async_scheduling=mode == "async"),
                  ExecutorLimits(BS, 96, 0, max_model_len=MAX_MODEL_LEN, eos_token_ids=(EOS,)))
    ex = ModelExecutor(96, 1, BS)
    for request in requests():
        s.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests()}
    sampled = dict.fromkeys(tokens, 0)
    done: dict[str, Finished] = {}
    pending: list[tuple[SchedulerOutput, ExecutorResult]] = []

    def update(out: SchedulerOutput, result: ExecutorResult) -> None:
        per_request.clear()
        for d in s.update(out, result):
            tokens[d.request_id] += d.new_token_ids
            if d.finish_reason is not None:
                rid = d.request_id
                done[rid] = Finished(tokens[rid], d.finish_reason, rid in per_request, sampled[rid])
        if s.rs.stops.rules is STOP_RULES:  # check_columns knows the built-in table's columns
            check_columns(s)

    for _ in range(200):
        if not s.has_unfinished():
            break
        out = s.schedule()
        result = ex.step(out)
        for w in out.scheduled:
            sampled[w.request.request_id] += len(result.tokens_of(w.request.request_id) or ())
        if mode == "per-request":
            result.logprobs = {w.request.request_id: [] for w in out.scheduled}
        pending.append((out, result))
        if len(pending) > (mode == "async"):
            update(*pending.pop(0))
    for late in pending:
        update(*late)
    assert not s.has_unfinished()
    return done


@pytest.mark.parametrize("kind", list(TOYS))
@pytest.mark.parametrize("mode", MODES)
def test_a_rule_added_to_the_table_alone_stops_requests_on_both_paths(
        monkeypatch: pytest.MonkeyPatch, kind: str, mode: str) -> None:
    rule, reason, oracle = TOYS[kind]
    monkeypatch.setattr(stop_rules, "STOP_RULES", (*STOP_RULES, rule))  # the one place the rule is added
    done = drive(monkeypatch, mode)
    by_toy, by_column = [], []
    for request in requests():
        rid = request.request_id
        end = done[rid]
        assert (end.tokens, end.reason) == expected(request, oracle, reason), rid
        if end.reason is FinishReason.LENGTH or mode != "async":
            # nothing is scheduled past a length limit, not even ahead of an update (async scheduling)
            assert end.sampled == len(end.tokens), f"{rid}: scheduled past its end"
        if end.reason is reason and len(end.tokens) < MAX_TOKENS:
            by_toy.append(rid)
            if mode == "per-request":
                assert end.per_request, f"{rid}: the answer had logprobs, yet its update took the columns"
            elif len(end.tokens) > 1 and not request.sampling.stop_token_ids:
                # a plain decode whose row only the toy rule's own column can flag
                assert not end.per_request, f"{rid}: its last decode did not take the vectorised update"
                by_column.append(rid)
    assert len(by_toy) >= 3, f"the toy {kind} rule ended too few requests to tell: {by_toy}"
    assert mode == "per-request" or by_column, "no plain, unwatched decode was ended by the toy rule"


def test_without_the_toy_rules_every_request_runs_to_max_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """The toy rules' stops are theirs: the built-in table alone ends every request at max_tokens."""
    done = drive(monkeypatch, "columns")
    assert all((len(end.tokens), end.reason) == (MAX_TOKENS, FinishReason.LENGTH) for end in done.values())


SAMPLINGS = [SamplingOptions(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos, priority=priority,
                              stop_token_ids=stop)
             for max_tokens in (1, 3, 9) for min_tokens in (0, 2) for ignore_eos in (False, True)
             for priority in range(4) for stop in ((), (9,)) if min_tokens <= max_tokens]


@pytest.mark.parametrize("toy", [None, *TOYS])
def test_the_columns_flag_every_row_the_per_request_rules_would_stop(toy: str | None) -> None:
    """For the built-in table and with each toy rule added: of every request (a grid of options, prompt
    lengths, output lengths, sampled tokens) that the per-request check stops, the vectorised check over
    its row's columns flags the row."""
    rules = STOP_RULES if toy is None else (*STOP_RULES, TOYS[toy][0])
    table = StopTable(ExecutorLimits(BS, 8, 0, max_model_len=14, eos_token_ids=(2, 13)), rules)
    rs = RunningSet(table)
    stops = 0
    for sampling in SAMPLINGS:
        for num_prompt in (1, 5):
            for num_output in range(1, 10):
                for token in (2, 9, 13, 17, 18):
                    request = Request("r", [7] * num_prompt, sampling, 0.0, output_token_ids=[5] * (num_output - 1))
                    rs.add(request, 64)
                    request.output_token_ids.append(token)
                    slots = np.array([request.slot])
                    flagged = rs.may_stop(slots, slots * 0 + request.num_tokens, [token])[0]
                    reason = stop_reason(rs.plans[request.slot], sampling, token, num_output, num_prompt + num_output)
                    assert flagged or reason is None, (sampling, num_prompt, num_output, token, reason)
                    stops += reason is not None
                    rs.remove(request)
    assert stops
