"""The stop rules, written once: one table (STOP_RULES) that the per-request check and the running set's
stop columns are both read from.

A rule ends a request after a sampled token. Each rule is of one of four kinds, by what the vectorised
update of the step's plain decodes (decode_rows.py) can test for it without looking at the request:

- LengthRule: fires once the request holds length() tokens. Column `limit`: the least length of the
  length rules; a row that reaches it is checked.
- TokenRule: fires when the sampled token is one of tokens(limits) (the same ids for every request,
  e.g. the model's EOS ids) and the request listens(). Column `listen[k]` for the k-th token rule with
  ids: a row that listens and sampled one of them is checked.
- RequestTokenRule: fires when the sampled token is one of the request's own ids, tokens_of(sampling)
  (stop_token_ids). Column `watch`: a row with any is checked every step.
- StopRule, any other: fires() on whatever it likes; watched(sampling) says which requests it may end,
  and their rows are checked every step (column `watch`). It watches every request unless it says
  otherwise, so a rule that names no column is still obeyed by both paths, only more slowly.

When a request enters the running set, StopTable.row() reads the table for it once: the values of its
stop columns, and its stop plan, the rules that apply to it in table order with their lengths and
token ids worked out. The per-request check (stop_reason) walks the plan, the first rule that fires
giving the reason; the vectorised check (StopTable.may_stop) picks the rows that must walk through it.
A rule of the first three kinds may also define fires() to narrow its condition (asked only once its
length or token matched), never to widen it; a general rule is asked only for the requests it
watches. A `gated` rule does not fire while fewer than the request's min_tokens tokens are out.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from scheduler_service.core.config import ExecutorLimits
from scheduler_service.core.request import FinishReason, SamplingOptions

NO_LIMIT = int(np.iinfo(np.int64).max)
Fires = Callable[[SamplingOptions, int, int, int], bool]


class StopRule:
    """A rule of the general kind: fires() is its check, watched() the requests it may end."""

    reason: FinishReason = FinishReason.STOPPED
    gated: bool = True  # held back while fewer than min_tokens tokens are out

    def fires(self, sampling: SamplingOptions, token: int, num_output: int, num_tokens: int) -> bool:
        """Whether the request stops after appending token (now num_output outputs, num_tokens in all)."""
        raise NotImplementedError

    def watched(self, sampling: SamplingOptions) -> bool:
        """Whether this rule may end a request with these options (general kind only)."""
        return True


class LengthRule(StopRule):
    """Fires once the request holds length() tokens, prompt and output."""

    reason = FinishReason.LENGTH

    def length(self, sampling: SamplingOptions, num_prompt: int, limits: ExecutorLimits) -> int:
        raise NotImplementedError


class TokenRule(StopRule):
    """Fires when the sampled token is one of tokens() (ids shared by every request) and the request
    listens()."""

    def tokens(self, limits: ExecutorLimits) -> tuple[int, ...]:
        raise NotImplementedError

    def listens(self, sampling: SamplingOptions) -> bool:
        return True


class RequestTokenRule(StopRule):
    """Fires when the sampled token is one of the request's own tokens_of()."""

    def tokens_of(self, sampling: SamplingOptions) -> tuple[int, ...]:
        raise NotImplementedError


class MaxModelLen(LengthRule):
    gated = False  # the model holds no more, min_tokens or not

    def length(self, sampling: SamplingOptions, num_prompt: int, limits: ExecutorLimits) -> int:
        return limits.max_model_len


class Eos(TokenRule):
    def tokens(self, limits: ExecutorLimits) -> tuple[int, ...]:
        return limits.eos_token_ids

    def listens(self, sampling: SamplingOptions) -> bool:
        return not sampling.ignore_eos


class StopTokens(RequestTokenRule):
    def tokens_of(self, sampling: SamplingOptions) -> tuple[int, ...]:
        return sampling.stop_token_ids


class MaxTokens(LengthRule):
    def length(self, sampling: SamplingOptions, num_prompt: int, limits: ExecutorLimits) -> int:
        return num_prompt + sampling.max_tokens


STOP_RULES: tuple[StopRule, ...] = (Eos(), StopTokens(), MaxModelLen(), MaxTokens())
"""The stop rules, in the order the per-request check asks them (the first that fires gives the reason):
vLLM's order, min_tokens (the `gated` rules held back), EOS, stop tokens, then length, so an EOS or stop
token sampled as the last allowed token (max_tokens or max_model_len) finishes as `stop`, not `length`."""


Entry = tuple[int, tuple[int, ...] | None, Fires | None, FinishReason]
Plan = tuple[int, tuple[int, ...], tuple[Entry, ...]]
"""A request's stop plan: per rule that applies to it, in table order, an entry (the tokens at which it
may fire, the token ids it fires on or None for any, its own fires() to ask once those match or None,
its reason); ahead of them, the fewest tokens at which any may fire (0 if a general rule applies) and
all their token ids, so that the usual answer, none fires, takes two comparisons."""
Plans = tuple[Plan, Plan]
"""A row's two stop plans: all its rules, and those that fire while min_tokens holds the others back."""


def stop_reason(plans: Plans, sampling: SamplingOptions, token: int, num_output: int,
                num_tokens: int) -> FinishReason | None:
    """Why a request with these stop plans stops after appending token (now num_output outputs, num_tokens
    in all), or None: the per-request check."""
    below, any_ids, entries = plans[num_output < sampling.min_tokens]
    if num_tokens < below and token not in any_ids:
        return None
    for at, ids, fires, reason in entries:
        if num_tokens >= at and (ids is None or token in ids) and (
                fires is None or fires(sampling, token, num_output, num_tokens)):
            return reason
    return None


def _plan(entries: list[Entry]) -> Plan:
    below = min((at for at, ids, _, _ in entries if ids is None), default=NO_LIMIT)  # a general rule: 0
    id_sets = [ids for _, ids, _, _ in entries if ids is not None]
    any_ids = id_sets[0] if len(id_sets) == 1 else tuple(token for ids in id_sets for token in ids)
    return below, any_ids, tuple(entries)


NO_PLAN: Plan = (NO_LIMIT, (), ())


class StopTable:
    """The rule table bound to one executor's limits: each request's stop plans and stop columns, and the
    vectorised check. STOP_RULES is read when the table is built (the scheduler builds one with each
    RunningSet)."""

    __slots__ = ("_steps", "limits", "rules", "token_sets")

    def __init__(self, limits: ExecutorLimits, rules: tuple[StopRule, ...] | None = None) -> None:
        self.limits = limits
        self.rules = STOP_RULES if rules is None else rules
        # per rule: its own fires() where it narrows a length or token condition, and its plan entry where
        # that is the same for every request (made once here, shared by the rows)
        steps: list[tuple[StopRule, Fires | None, Entry | None]] = []
        token_sets = []
        for rule in self.rules:
            narrows = None if type(rule).fires is StopRule.fires else rule.fires
            shared: Entry | None = None
            if isinstance(rule, TokenRule):
                ids = rule.tokens(limits)
                if not ids:
                    continue
                token_sets.append(ids)
                shared = (0, ids, narrows, rule.reason)
            elif not isinstance(rule, LengthRule | RequestTokenRule):
                shared = (0, None, rule.fires, rule.reason)
            steps.append((rule, narrows, shared))
        self._steps = tuple(steps)
        self.token_sets = tuple(token_sets)  # one `listen` column each

    def row(self, sampling: SamplingOptions, num_prompt: int) -> tuple[Plans, int, bool, list[bool]]:
        """A request's stop plans and its stop columns: `limit` (the least length of a length rule),
        `watch` (the rules' part: a rule only the per-request check can test applies, or min_tokens holds
        it, as the columns always had it) and `listen` (per token rule with ids, whether it listens)."""
        limits = self.limits
        every: list[Entry] = []
        held: list[Entry] = []
        limit, watch, listens = NO_LIMIT, sampling.min_tokens > 0, []
        for rule, narrows, entry in self._steps:
            if isinstance(rule, LengthRule):
                at = rule.length(sampling, num_prompt, limits)
                limit = min(limit, at)
                entry = (at, None, narrows, rule.reason)
            elif isinstance(rule, TokenRule):
                listens.append(rule.listens(sampling))
                if not listens[-1]:
                    continue
            elif isinstance(rule, RequestTokenRule):
                ids = rule.tokens_of(sampling)
                if not ids:
                    continue
                watch = True
                entry = (0, ids, narrows, rule.reason)
            elif rule.watched(sampling):
                watch = True
            else:
                continue
            assert entry is not None
            every.append(entry)
            if not rule.gated:
                held.append(entry)
        # the second plan is read only while fewer than min_tokens tokens are out
        return (_plan(every), _plan(held) if sampling.min_tokens > 0 else NO_PLAN), limit, watch, listens

    def may_stop(self, slots: np.ndarray, num_tokens: np.ndarray, tokens: list[int], limit: np.ndarray,
                 watch: np.ndarray, listen: list[np.ndarray]) -> np.ndarray:
        """Of the plain decodes in rows `slots`, which appended `tokens` and now hold num_tokens, the mask of
        those some rule may end: at or past their length limit, watched, or listening to a token rule whose
        ids they sampled. Only these walk through stop_reason()."""
        check: np.ndarray = (num_tokens >= limit[slots]) | watch[slots]
        if self.token_sets:
            sampled = np.fromiter(tokens, np.int64, len(tokens))
            for ids, column in zip(self.token_sets, listen, strict=True):
                hit = sampled == ids[0]
                for token in ids[1:]:
                    hit |= sampled == token
                check |= column[slots] & hit
        return check
