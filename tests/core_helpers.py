"""In-process stand-ins to drive the pure scheduler core in tests."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from scheduler_service.core.outputs import ExecutorResult, SchedulerOutput
from scheduler_service.core.request import Request, SamplingOptions


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_request(rid: str, prompt_len: int, max_tokens: int = 16, arrival: float = 0.0,
                 **sampling: object) -> Request:
    """A prompt of prompt_len tokens that starts with a token of its own, so no two requests share a
    cached prefix unless a test gives them one."""
    options = SamplingOptions(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, ([1000 + zlib.crc32(rid.encode()) % 10_000] + [7] * (prompt_len - 1))[:prompt_len],
                   options, arrival)


def token_for(rid: str, position: int) -> int:
    return 100 + (hash((rid, position)) % 1000)


def run_step(out: SchedulerOutput, chooser: Callable[[str, int], int] = token_for) -> ExecutorResult:
    """Answer a step the way an executor would: tokens for every request whose tokens are all computed."""
    result = ExecutorResult()
    for work in out.scheduled:
        req = work.request
        if req.num_computed_tokens + work.num_tokens < req.num_tokens:
            continue
        position = req.num_tokens
        result.sampled[req.request_id] = [chooser(req.request_id, position + i) for i in range(out.num_steps)]
    return result
