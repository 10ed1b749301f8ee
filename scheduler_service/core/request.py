"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOPPED = "stop"
    LENGTH = "length"
    ABORTED = "abort"
    ERROR = "error"


@dataclass(slots=True, frozen=True)
class SamplingOptions:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    priority: int = 0


@dataclass(slots=True, eq=False)
class Request:
    """share_prompt_with names a sibling of the same n > 1 request (same prompt): this sequence
    shares the sibling's computed prompt blocks instead of computing them again. num_cached_tokens:
    prompt tokens it found computed at its first admission (-1 before it)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float
    output_len_hint: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str = ""
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = -1
    first_scheduled_time: float | None = None
    share_prompt_with: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def remaining_output(self) -> int:
        expected = self.output_len_hint if self.output_len_hint is not None else self.sampling.max_tokens
        return max(0, expected - self.num_output_tokens)
