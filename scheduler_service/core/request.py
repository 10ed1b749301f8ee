"""A request as the scheduler sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protos.contract import SAMPLING, SamplingConfig
from scheduler_service.core.prompt_logprobs import PromptLogprobsRecord
from scheduler_service.core.speculative import DraftRecord


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


class ConstraintKind(enum.IntEnum):
    """What a structured-output constraint's spec is (common.proto's StructuredOutputs)."""

    JSON_SCHEMA = 1
    JSON_OBJECT = 2
    REGEX = 3
    CHOICE = 4
    GRAMMAR = 5


@dataclass(slots=True, frozen=True)
class Constraint:
    """A request's structured-output constraint: its kind and spec (a JSON schema's text, a regex, an EBNF
    grammar, the choices as a JSON list, "" for any JSON object). The engine keeps its grammar state; the core
    only carries it."""

    kind: ConstraintKind
    spec: str = ""


@dataclass(slots=True, frozen=True)
class SamplingOptions(SamplingConfig):
    """A request's validated sampling parameters: the sampler's (SamplingConfig) and the scheduler's own;
    defaults from protos/contract.py's SAMPLING table."""

    max_tokens: int = SAMPLING.max_tokens.default
    ignore_eos: bool = False
    priority: int = SAMPLING.priority.default
    constraint: Constraint | None = None


@dataclass(slots=True, eq=False)
class Request:
    """share_prompt_with names a sibling of the same n > 1 request (same prompt): this sequence
    shares the sibling's computed prompt blocks instead of computing them again. num_cached_tokens:
    prompt tokens it found computed at its first admission (-1 before it). The computed count is kept
    as the number of known tokens not yet computed, so a decode that computes one token and samples the
    next changes nothing but the output list. slot: its row in the scheduler's RunningSet while RUNNING.
    tenant and cache_salt are its prefix-cache scope (block_hash): the api server's keyed digest of the
    caller's API key ("" when none, or when the cache is shared across tenants) and vLLM's per-request salt;
    only requests of the same scope share cached blocks. drafts: its speculation record (speculative.py)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    arrival_time: float
    output_len_hint: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str = ""
    num_uncomputed_tokens: int = field(init=False)
    num_preemptions: int = 0
    num_cached_tokens: int = -1
    first_scheduled_time: float | None = None
    share_prompt_with: str | None = None
    slot: int = -1
    cache_salt: str | None = None
    tenant: str = ""
    owner: str = ""  # who sent it (its API key's digest; "" without keys): whose turn its admission and grammar
    # compile take (the waiting queue and the compile queue take turns between owners)
    drafts: DraftRecord | None = None  # its speculative decoding so far (None: never proposed for)
    prompt_logprobs: PromptLogprobsRecord | None = field(init=False)  # None: it does not ask for them

    def __post_init__(self) -> None:
        self.num_uncomputed_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)
        asked = self.sampling.prompt_logprobs is not None
        self.prompt_logprobs = PromptLogprobsRecord(max(0, len(self.prompt_token_ids) - 1)) if asked else None

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and has not had them: its prompt must be computed, not found cached."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs.delivered

    @property
    def num_computed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_uncomputed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        self.num_uncomputed_tokens = len(self.prompt_token_ids) + len(self.output_token_ids) - value

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
