"""GenerateRequest validation: every rejection names the field and its allowed range."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos.pagedserve.v1 import generation_pb2
from scheduler_service.core.request import SamplingOptions

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_N = 16
MAX_PRIORITY = 2**31 - 1


class InvalidArgument(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True, frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(field, message)


def _finite(value: float, field: str) -> None:
    _check(math.isfinite(value), field, f"must be a finite number, got {value}")


def validate_prompt(req: generation_pb2.GenerateRequest, limits: Limits) -> None:
    has_text, has_ids = bool(req.prompt), bool(req.prompt_token_ids)
    _check(has_text or has_ids, "prompt", "give exactly one of prompt or prompt_token_ids (neither was set)")
    _check(not (has_text and has_ids), "prompt",
           "give exactly one of prompt or prompt_token_ids (both were set)")
    for i, t in enumerate(req.prompt_token_ids):
        _check(t < limits.vocab_size, f"prompt_token_ids[{i}]",
               f"token id {t} outside the vocabulary [0, {limits.vocab_size})")
    _check(len(req.request_id) <= 256, "request_id", "at most 256 characters")
    _check("#" not in req.request_id, "request_id", "may not contain '#' (it names the sequences of n > 1)")


def sampling_options(req: generation_pb2.GenerateRequest, limits: Limits, prompt_len: int) -> SamplingOptions:
    p = req.sampling
    room = limits.max_model_len - prompt_len
    _check(prompt_len >= 1, "prompt", "the prompt encodes to no tokens")
    _check(room >= 1, "prompt", f"prompt has {prompt_len} tokens; max_model_len is {limits.max_model_len}")
    max_tokens = p.max_tokens if p.HasField("max_tokens") else min(16, room)
    _check(max_tokens >= 1, "sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    _check(max_tokens <= room, "sampling.max_tokens",
           f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
           f"{limits.max_model_len}; allowed range [1, {room}]")
    _check(p.min_tokens <= max_tokens, "sampling.min_tokens", f"must be in [0, max_tokens={max_tokens}]")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    _finite(temperature, "sampling.temperature")
    _check(temperature >= 0, "sampling.temperature", f"must be >= 0, got {temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    _check(0 < top_p <= 1, "sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = p.top_k if p.HasField("top_k") else -1
    _check(top_k >= -1, "sampling.top_k", f"must be -1 (off), 0 (off) or positive, got {top_k}")
    _check(0 <= p.min_p <= 1, "sampling.min_p", f"must be in [0, 1], got {p.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        _check(-2 <= value <= 2, f"sampling.{name}", f"must be in [-2, 2], got {value}")
    repetition = p.repetition_penalty if p.HasField("repetition_penalty") else 1.0
    _check(0 < repetition <= 2, "sampling.repetition_penalty", f"must be in (0, 2], got {repetition}")
    logprobs = p.logprobs if p.HasField("logprobs") else None
    _check(logprobs is None or logprobs <= limits.max_logprobs, "sampling.logprobs",
           f"must be in [0, {limits.max_logprobs}], got {logprobs}")
    n = p.n if p.HasField("n") else 1
    _check(1 <= n <= MAX_N, "sampling.n", f"must be in [1, {MAX_N}], got {n}")
    _check(len(p.stop) <= MAX_STOP_STRINGS, "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(p.stop):
        _check(0 < len(s) <= MAX_STOP_STRING_LEN, f"sampling.stop[{i}]",
               f"length must be in [1, {MAX_STOP_STRING_LEN}]")
    _check(len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "sampling.stop_token_ids",
           f"at most {MAX_STOP_TOKEN_IDS} ids")
    for i, t in enumerate(p.stop_token_ids):
        _check(t < limits.vocab_size, f"sampling.stop_token_ids[{i}]",
               f"token id {t} outside the vocabulary [0, {limits.vocab_size})")
    _check(abs(p.priority) <= MAX_PRIORITY, "sampling.priority", "out of int32 range")
    return SamplingOptions(
        max_tokens=max_tokens, min_tokens=p.min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=p.min_p, seed=p.seed if p.HasField("seed") else None, stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=repetition, logprobs=logprobs, priority=p.priority)
