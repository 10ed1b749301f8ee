"""OpenAI request bodies to GenerateRequests: type checks here, ranges in scheduler_service.frontend.validation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from protos.pagedserve.v1 import common_pb2
from scheduler_service.frontend.openai.errors import ApiError, bad_param

Prompt = str | list[int]
UINT32 = 2**32
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
UINT_PARAMS = ("min_tokens", "n")
REFUSED_PARAMS = ("suffix", "logit_bias", "tools", "functions", "response_format")


@dataclass(slots=True)
class ApiRequest:
    """What both endpoints share once the body is read."""

    model: str | None
    sampling: common_pb2.SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    prompts: list[Prompt] = field(default_factory=list)
    max_tokens_given: bool = False
    cache_salt: str | None = None


def parse_completion(body: Any) -> ApiRequest:
    body = require_object(body)
    request = parse_common(body, ("max_tokens",))
    request.prompts = parse_prompts(body.get("prompt"))
    logprobs = body.get("logprobs")
    if logprobs is not None:
        request.logprobs = read_uint(body, "logprobs")
        request.sampling.logprobs = request.logprobs
    if body.get("echo"):
        raise bad_param("echo", "echo is not supported")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (request.sampling.n if request.sampling.HasField("n") else 1):
        raise bad_param("best_of", "only best_of equal to n is supported")
    return request


def parse_chat(body: Any) -> tuple[ApiRequest, list[dict[str, Any]], dict[str, Any]]:
    """The request, the messages (content flattened to text), and extra template variables."""
    body = require_object(body)
    request = parse_common(body, ("max_completion_tokens", "max_tokens"))
    if body.get("logprobs"):
        top = body.get("top_logprobs")
        request.logprobs = 0 if top is None else read_uint(body, "top_logprobs")
        request.sampling.logprobs = request.logprobs
    messages = parse_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_param("chat_template_kwargs", "must be an object")
    kwargs = {**kwargs, "add_generation_prompt": bool(body.get("add_generation_prompt", True))}
    return request, messages, kwargs


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def parse_common(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> ApiRequest:
    for name in REFUSED_PARAMS:
        if body.get(name):
            raise bad_param(name, f"{name} is not supported by this server")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "must be a string")
    sampling = common_pb2.SamplingParams()
    request = ApiRequest(model, sampling, stream=read_bool(body, "stream"))
    for key in max_tokens_keys:
        if body.get(key) is not None:
            sampling.max_tokens = read_uint(body, key)
            request.max_tokens_given = True
            break
    for name in FLOAT_PARAMS:
        if body.get(name) is not None:
            setattr(sampling, name, read_float(body, name))
    for name in UINT_PARAMS:
        if body.get(name) is not None:
            setattr(sampling, name, read_uint(body, name))
    if body.get("top_k") is not None:
        sampling.top_k = read_int(body, "top_k", -1, 2**31)
    if body.get("seed") is not None:
        sampling.seed = read_int(body, "seed", -(2**63), 2**64) % 2**64
    if body.get("priority") is not None:
        sampling.priority = read_int(body, "priority", -(2**31) + 1, 2**31)
    sampling.ignore_eos = read_bool(body, "ignore_eos")
    sampling.stop.extend(read_stop(body.get("stop")))
    sampling.stop_token_ids.extend(read_token_ids(body.get("stop_token_ids") or [], "stop_token_ids"))
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad_param("cache_salt", "must be a non-empty string if provided")
        request.cache_salt = salt
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_param("stream_options", "must be an object")
        request.include_usage = bool(options.get("include_usage"))
    return request


def read_bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_param(name, f"must be a boolean, got {value!r}")
    return value


def read_float(body: dict[str, Any], name: str) -> float:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_param(name, f"must be a number, got {value!r}")
    return float(value)


def read_int(body: dict[str, Any], name: str, lo: int, hi: int) -> int:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_param(name, f"must be an integer, got {value!r}")
    if not lo <= value < hi:
        raise bad_param(name, f"must be in [{lo}, {hi - 1}], got {value}")
    return value


def read_uint(body: dict[str, Any], name: str) -> int:
    return read_int(body, name, 0, UINT32)


def read_stop(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise bad_param("stop", "must be a string or a list of strings")


def read_token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_param(name, "must be a list of token ids")
    if any(not 0 <= t < UINT32 for t in value):
        raise bad_param(name, "token ids must be non-negative")
    return value


def parse_prompts(value: Any) -> list[Prompt]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_param("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
        return [read_token_ids(value, "prompt")]
    if all(isinstance(p, list) for p in value):
        return [read_token_ids(p, "prompt") for p in value]
    raise bad_param("prompt", "must be a string, a list of token ids, or a list of either")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "must be a non-empty list of messages")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_param("messages", f"messages[{i}] must be an object with a string role")
        messages.append({**message, "content": message_text(message.get("content"), i)})
    return messages


def message_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param("messages", f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param("messages", f"messages[{index}].content must be a string or a list of text parts")
