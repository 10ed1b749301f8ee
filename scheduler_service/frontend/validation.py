"""GenerateRequest validation: every rejection names the field and its allowed range."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError

from protos.contract import SAMPLING, SamplingParam
from protos.pagedserve.v1 import common_pb2, generation_pb2
from scheduler_service.core.request import SamplingOptions

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REQUEST_ID_LEN = 256
MAX_CACHE_SALT_LEN = 1024
MAX_LOGIT_BIAS = 1024


class InvalidArgument(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(slots=True, frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_prompt_bytes: int
    prompt_logprobs: bool = True  # the executor computes them (Describe.capabilities.prompt_logprobs)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(field, message)


def _finite(value: float, field: str) -> None:
    _check(math.isfinite(value), field, f"must be a finite number, got {value}")


def max_prompt_bytes(max_model_len: int, max_token_bytes: int, max_request_bytes: int) -> int:
    """The longest prompt text worth tokenizing: no text longer than max_model_len tokens of the longest
    token can fit, and none longer than a request message may carry."""
    return max(1, min(max_model_len * max_token_bytes, max_request_bytes))


def validate_prompt(req: generation_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """Cheap checks, before any tokenization: sizes first, so oversized input costs nothing."""
    has_text, has_ids = bool(req.prompt), bool(req.prompt_token_ids)
    _check(has_text or has_ids, "prompt", "give exactly one of prompt or prompt_token_ids (neither was set)")
    _check(not (has_text and has_ids), "prompt",
           "give exactly one of prompt or prompt_token_ids (both were set)")
    _check(len(req.request_id) <= MAX_REQUEST_ID_LEN, "request_id", f"at most {MAX_REQUEST_ID_LEN} characters")
    if req.HasField("cache_salt"):
        _check(0 < len(req.cache_salt) <= MAX_CACHE_SALT_LEN, "cache_salt",
               f"must be a non-empty string of at most {MAX_CACHE_SALT_LEN} characters when set")
    if has_text:
        size = len(req.prompt.encode())
        _check(size <= limits.max_prompt_bytes, "prompt",
               f"{size} bytes is more than max_model_len {limits.max_model_len} tokens can hold "
               f"(at most {limits.max_prompt_bytes} bytes)")
    ids = req.prompt_token_ids
    _check(len(ids) < limits.max_model_len, "prompt_token_ids",
           f"{len(ids)} tokens; max_model_len is {limits.max_model_len}")
    if ids and max(ids) >= limits.vocab_size:
        i = next(i for i, t in enumerate(ids) if t >= limits.vocab_size)
        raise InvalidArgument(f"prompt_token_ids[{i}]",
                              f"token id {ids[i]} outside the vocabulary [0, {limits.vocab_size})")
    _check("#" not in req.request_id, "request_id", "may not contain '#' (it names the sequences of n > 1)")


def _in_range(name: str, value: float, high: float | None = None) -> None:
    param: SamplingParam[Any] = getattr(SAMPLING, name)
    ok = param.allows(value) and (high is None or value <= high)
    _check(ok, f"sampling.{name}", f"must be {param.describe(high)}, got {value}")


def _given(p: common_pb2.SamplingParams, name: str) -> Any:
    """The field's value, or the table's default when an optional field is unset."""
    return getattr(p, name) if p.HasField(name) else getattr(SAMPLING, name).default


def sampling_options(req: generation_pb2.GenerateRequest, limits: RequestLimits, prompt_len: int) -> SamplingOptions:
    p = req.sampling
    room = limits.max_model_len - prompt_len
    _check(prompt_len >= 1, "prompt", "the prompt encodes to no tokens")
    _check(room >= 1, "prompt", f"prompt has {prompt_len} tokens; max_model_len is {limits.max_model_len}")
    max_tokens = p.max_tokens if p.HasField("max_tokens") else min(SAMPLING.max_tokens.default, room)
    _in_range("max_tokens", max_tokens)
    _check(max_tokens <= room, "sampling.max_tokens",
           f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
           f"{limits.max_model_len}; allowed range [1, {room}]")
    _check(p.min_tokens <= max_tokens, "sampling.min_tokens", f"must be in [0, max_tokens={max_tokens}]")
    temperature, top_p, top_k = _given(p, "temperature"), _given(p, "top_p"), _given(p, "top_k")
    _finite(temperature, "sampling.temperature")
    _in_range("temperature", temperature)
    _in_range("top_p", top_p)
    _in_range("top_k", top_k)
    for name in ("min_p", "presence_penalty", "frequency_penalty"):
        _in_range(name, getattr(p, name))
    repetition = _given(p, "repetition_penalty")
    _in_range("repetition_penalty", repetition)
    logprobs = _given(p, "logprobs")
    if logprobs is not None:
        _in_range("logprobs", logprobs, limits.max_logprobs)
    prompt_logprobs = _given(p, "prompt_logprobs")
    if prompt_logprobs is not None:
        _in_range("prompt_logprobs", prompt_logprobs, limits.max_logprobs)
        _check(limits.prompt_logprobs, "sampling.prompt_logprobs",
               "this executor does not compute prompt logprobs (Describe.capabilities.prompt_logprobs)")
    _in_range("n", _given(p, "n"))
    _check(len(p.stop) <= MAX_STOP_STRINGS, "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, s in enumerate(p.stop):
        _check(0 < len(s) <= MAX_STOP_STRING_LEN, f"sampling.stop[{i}]",
               f"length must be in [1, {MAX_STOP_STRING_LEN}]")
    _check(len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "sampling.stop_token_ids",
           f"at most {MAX_STOP_TOKEN_IDS} ids")
    for i, t in enumerate(p.stop_token_ids):
        _check(t < limits.vocab_size, f"sampling.stop_token_ids[{i}]",
               f"token id {t} outside the vocabulary [0, {limits.vocab_size})")
    logit_bias = checked_logit_bias(p, limits)
    return SamplingOptions(
        max_tokens=max_tokens, min_tokens=p.min_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=p.min_p, seed=_given(p, "seed"), stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos, presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=repetition, logprobs=logprobs, priority=p.priority, logit_bias=logit_bias,
        prompt_logprobs=prompt_logprobs)


def checked_logit_bias(p: common_pb2.SamplingParams, limits: RequestLimits) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: at most MAX_LOGIT_BIAS ids in the vocabulary, each bias finite in [-100, 100]."""
    bias = p.logit_bias
    _check(len(bias) <= MAX_LOGIT_BIAS, "sampling.logit_bias", f"at most {MAX_LOGIT_BIAS} token ids")
    for token_id, value in sorted(bias.items()):
        field = f"sampling.logit_bias[{token_id}]"
        _check(token_id < limits.vocab_size, field, f"token id outside the vocabulary [0, {limits.vocab_size})")
        _check(math.isfinite(value) and SAMPLING.logit_bias.allows(value), field,
               f"must be {SAMPLING.logit_bias.describe()}, got {value}")
    return tuple(sorted(bias.items()))


@dataclass(slots=True, frozen=True)
class MalformedRequest:
    """What parse_generate_request gives for bytes that are no valid GenerateRequest."""

    error: InvalidArgument


def parse_generate_request(data: bytes) -> generation_pb2.GenerateRequest | MalformedRequest:
    """The Generate deserializer: never raises, so a bad body becomes INVALID_ARGUMENT, not UNKNOWN."""
    try:
        return generation_pb2.GenerateRequest.FromString(data)
    except DecodeError:
        field = invalid_utf8_field(data, generation_pb2.GenerateRequest.DESCRIPTOR)
        if field is not None:
            return MalformedRequest(InvalidArgument(field, "not valid UTF-8"))
        return MalformedRequest(InvalidArgument("request", "not a valid GenerateRequest message"))


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise DecodeError("truncated varint")
        b = data[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


MAX_GROUP_NESTING = 100
"""Unknown groups nested deeper than protobuf's own recursion limit are no valid message."""
MAX_SCANNED_FIELDS = 8192
"""Fields the scan for a field that is not UTF-8 reads, at every level, before it gives up (the message is then
refused as not a GenerateRequest): it runs in Python on the event loop (~1 us a field), and a 4 MB message of empty
groups or unknown varints held the api server's other streams 3 - 4.5 s. A GenerateRequest has a few dozen fields
(1,024 logit_bias entries take 3,072)."""


class ScanBudget:
    def __init__(self, fields: int = MAX_SCANNED_FIELDS) -> None:
        self.left = fields

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise DecodeError("too many fields to scan")


def _skip(data: bytes, i: int, wire_type: int, number: int, budget: ScanBudget) -> int:
    """Past the value of field `number` (an unknown field may be any wire type, a group included), without
    recursion."""
    if wire_type == 0:
        return _varint(data, i)[1]
    if wire_type in (1, 5):
        return i + (8 if wire_type == 1 else 4)
    if wire_type == 2:
        size, i = _varint(data, i)
        return i + size
    if wire_type != 3:
        raise DecodeError(f"unexpected wire type {wire_type}")
    groups = [number]
    while groups:
        budget.spend()
        key, i = _varint(data, i)
        if key & 7 == 4:
            if key >> 3 != groups.pop():
                raise DecodeError("end of a group that is not open")
        elif key & 7 == 3:
            if len(groups) >= MAX_GROUP_NESTING:
                raise DecodeError("groups nested too deep")
            groups.append(key >> 3)
        else:
            i = _skip(data, i, key & 7, key >> 3, budget)
    return i


def invalid_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "",
                       budget: ScanBudget | None = None) -> str | None:
    """The dotted name of the first string field whose bytes are not UTF-8, or None (also past the budget)."""
    budget = budget or ScanBudget()
    i = 0
    try:
        while i < len(data):
            budget.spend()
            key, i = _varint(data, i)
            field = descriptor.fields_by_number.get(key >> 3)
            if key & 7 != 2:
                i = _skip(data, i, key & 7, key >> 3, budget)
                continue
            size, i = _varint(data, i)
            chunk, i = data[i:i + size], i + size
            if field is None:
                continue
            name = prefix + field.name
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = invalid_utf8_field(chunk, field.message_type, name + ".", budget)
                if found is not None:
                    return found
    except DecodeError:
        return None
    return None
