"""What a random trace of the pure core produced, and the end-of-trace check that the property tests of the
plain and the hybrid (window groups) core share: every request finished, every block back in its pool, and each
request's tokens those of an undisturbed run."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import event

from scheduler_service.core.config import ExecutorLimits
from scheduler_service.core.logprobs import TokenLogprob
from scheduler_service.core.outputs import ExecutorResult
from scheduler_service.core.request import FinishReason, Request
from scheduler_service.core.scheduler import Scheduler
from tests.support.core_helpers import EOS, EOS2, TraceSpec, add_trace_arrivals
from tests.support.model_executor import token_at


@dataclass(slots=True)
class TraceOutputs:
    """Per request of a trace: the request, its tokens so far and its finish reason; which ones a stop string
    ended from outside (stopped_outside) and which an executor error ended (errors: request id -> error)."""
    requests: dict[str, Request] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    reasons: dict[str, FinishReason] = field(default_factory=dict)
    stopped_outside: set[str] = field(default_factory=set)
    errors: dict[str, str] = field(default_factory=dict)

    def add_arrivals(self, s: Scheduler, specs: list[TraceSpec], step: int, now: float) -> None:
        for request in add_trace_arrivals(s, specs, step, now):
            self.requests[request.request_id] = request
            self.outputs[request.request_id] = []


def reshape(result: ExecutorResult, rng: random.Random, errors: dict[str, str]) -> ExecutorResult:
    """The same answer in another shape: columns in any order, or token lists; sometimes with logprobs
    (they take the per-request path), an executor error for one request, one request's token missing
    (it fails alone) or a token for a request the step did not name."""
    sampled = dict(result.sampled) or {rid: [t] for rid, t in zip(result.ids, result.tokens, strict=True)}
    shape = rng.randrange(6)
    if shape == 3 and sampled and rng.randrange(25) == 0:  # a token missing: that request fails, alone
        missing = rng.choice(sorted(sampled))
        del sampled[missing]
        errors[missing] = "no token"
    if shape == 4:  # a token for a request the step did not name is ignored
        sampled = {"not-scheduled": [3], **sampled}
    ids = list(sampled)
    rng.shuffle(ids)
    if shape == 0 or any(len(t) != 1 for t in sampled.values()):
        reshaped = ExecutorResult(sampled={rid: sampled[rid] for rid in ids})
    else:
        reshaped = ExecutorResult(ids=ids, tokens=[sampled[rid][0] for rid in ids])
    if shape == 1 and ids:
        reshaped.logprobs = {ids[0]: [TokenLogprob(t, -1.0) for t in sampled[ids[0]]]}
    if shape == 2 and ids and rng.randrange(25) == 0:
        reshaped.errors = {ids[-1]: "injected"}
        errors[ids[-1]] = "injected"
    return reshaped


def expected_output(req: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    """The tokens and finish reason of the request run alone and undisturbed against the executor model."""
    out: list[int] = []
    n = req.num_prompt_tokens
    options = req.sampling
    while True:
        t = token_at(req.request_id, n + len(out), EOS, 23)
        out.append(t)
        if len(out) < options.min_tokens:
            if n + len(out) >= max_model_len:
                return out, FinishReason.LENGTH
            continue
        if (not options.ignore_eos and t in (EOS, EOS2)) or t in options.stop_token_ids:
            return out, FinishReason.STOPPED
        if n + len(out) >= max_model_len or len(out) >= options.max_tokens:
            return out, FinishReason.LENGTH


def check_trace_outputs(s: Scheduler, trace: TraceOutputs, limits: ExecutorLimits) -> None:
    """The end of a trace: nothing unfinished, every block free again, and each request's tokens and finish
    reason an undisturbed run's (a prefix of its tokens where a stop string or an executor error ended it;
    nothing to compare for an abort)."""
    assert not s.has_unfinished(), f"requests never finished: {list(s.requests)}"
    assert s.kv.device.num_free == limits.num_device_blocks and s.kv.cpu.num_free == limits.num_swap_blocks
    for rid, req in trace.requests.items():
        output, reason = trace.outputs[rid], trace.reasons[rid]
        expected = expected_output(req, limits.max_model_len)
        if rid in trace.stopped_outside or rid in trace.errors:
            assert output == expected[0][:len(output)], rid
            continue
        if reason in (FinishReason.ABORTED, FinishReason.ERROR):
            continue
        event(f"finished by {reason.value}{' at max_model_len' if req.num_tokens >= limits.max_model_len else ''}")
        assert (output, reason) == expected, rid
