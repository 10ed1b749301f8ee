"""OpenAI request bodies to GenerateRequests: type checks here, ranges in scheduler_service.frontend.validation."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protos.pagedserve.v1 import common_pb2
from scheduler_service.frontend.openai.errors import ApiError, bad_param
from scheduler_service.frontend.openai.tools import ToolCallParser, ToolRequest, read_tools
from scheduler_service.frontend.validation import MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

Prompt = str | list[int]
UINT32 = 2**32
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
UINT_PARAMS = ("min_tokens", "n")
REFUSED_PARAMS = ("functions", "function_call")
DEFAULT_ONLY: dict[str, Any] = {
    # vLLM's extensions this server does not implement: taken at their default (or null), refused otherwise rather
    # than ignored, since each changes what comes back.
    "skip_special_tokens": True, "spaces_between_special_tokens": True, "use_beam_search": False,
    "continue_final_message": False, "truncate_prompt_tokens": None,
    "allowed_token_ids": None, "bad_words": [], "logprob_token_ids": None,
}
# vLLM's structured_outputs keys -> StructuredOutputs fields; its older guided_* parameters say the same
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_PARAMS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
INT64 = 2**63
MAX_BODY_DEPTH = 64  # JSON nesting a request body may have (OpenAI's bodies need about 5)
# Strings, objects and lists a request body may hold (numbers are not counted): each costs the parser and the
# checks Python work on the event loop (~1-5 us), so a body of millions of `[1]` lists, messages or logit_bias keys
# held every other stream of the api server for seconds. 131,072 hold 10,000 prompts (the open-call limit) or
# tens of thousands of messages.
MAX_BODY_VALUES = 131_072
MAX_BODY_ITEMS = 1_048_576
"""List elements and object members a body may hold, numbers included: json.loads makes each a Python object on the
event loop (~0.12 us a number: four million token ids in a 60 MiB body held every other stream 6 - 8 s). A million
is a 128k-token prompt eight times over; a larger batch of token-id prompts is sent in parts."""
MAX_NUMBER_DIGITS = 40
"""Digits in a row a number of the body may have (a float prints in at most 17 significant digits, a 64-bit integer
in 20): json.loads converts a long decimal exactly, ~60 us for 767 digits, and a 60 MiB body of such numbers,
under the item limit, held every other stream 5.8 s."""
DIGIT_RUNS = bytes.maketrans(b"0123456789\x00", b"\x00" * 10 + b"\x01")  # digits -> NUL (a NUL itself -> 1)
VALUES_OVER = f"the request body holds more than {MAX_BODY_VALUES} strings, objects and lists"
NUMBER_OVER = f"a number in the request body has more than {MAX_NUMBER_DIGITS} digits"
ITEMS_OVER = (f"the request body holds more than {MAX_BODY_ITEMS} items (list elements and object members, token ids "
              "included); send a batch in several requests")
SCALARS = {int, float, bool, type(None)}
# Variables the server passes to the chat template itself: chat_template_kwargs may not replace them.
TEMPLATE_OWN_ARGS = ("messages", "bos_token", "eos_token", "unk_token", "pad_token", "raise_exception", "strftime_now")


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
    tools: ToolRequest | None = None
    echo: bool = False  # /v1/completions: each choice's text starts with its prompt
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs (/v1/completions): each choice carries them
    constraint_param: str | None = None  # the body parameter that gave sampling.structured_outputs


def parse_completion(body: Any, max_model_len: int | None = None) -> ApiRequest:
    """max_model_len (the executor's, when one is connected): a token-id prompt that long is refused before its
    ids are read."""
    body = require_object(body)
    request = parse_common(body, ("max_tokens",))
    request.prompts = parse_prompts(body.get("prompt"), max_model_len)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        request.logprobs = read_uint(body, "logprobs")
        request.sampling.logprobs = request.logprobs
    request.echo = read_bool(body, "echo")
    if body.get("prompt_logprobs") is not None:
        request.prompt_logprobs = read_uint(body, "prompt_logprobs")
    wanted = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
    if wanted:  # echo with logprobs: the prompt's tokens lead each choice's logprobs (OpenAI's legacy format)
        request.sampling.prompt_logprobs = max(wanted)
    best_of = body.get("best_of")
    if best_of is not None and best_of != (request.sampling.n if request.sampling.HasField("n") else 1):
        raise bad_param("best_of", "only best_of equal to n is supported")
    return request


def parse_chat(body: Any, tool_parser: ToolCallParser = ToolCallParser.NONE
               ) -> tuple[ApiRequest, list[dict[str, Any]], dict[str, Any]]:
    """The request, the messages (content flattened to text), and extra template variables."""
    body = require_object(body)
    request = parse_common(body, ("max_completion_tokens", "max_tokens"))
    if body.get("echo"):
        raise bad_param("echo", "echo is supported on /v1/completions only")
    if body.get("prompt_logprobs") is not None:
        raise bad_param("prompt_logprobs", "prompt_logprobs is supported on /v1/completions only")
    request.tools = read_tools(body, tool_parser)
    schema = request.tools.constraint_schema() if request.tools is not None else None
    if schema is not None:
        if request.sampling.HasField("structured_outputs"):
            raise bad_param("tool_choice", "a required or named tool choice cannot be combined with response_format "
                                           "or structured_outputs")
        for name in ("stop", "stop_token_ids"):
            if getattr(request.sampling, name):  # a streamed call's arguments cut short could not be taken back
                raise bad_param(name, f"{name} cannot be combined with a required or named tool_choice: the answer "
                                      "is the calls' JSON, which a stop would cut")
        request.sampling.structured_outputs.json = json.dumps(schema)
        request.constraint_param = "tools"
    top = read_uint(body, "top_logprobs") if body.get("top_logprobs") is not None else None
    if read_bool(body, "logprobs"):
        request.logprobs = top or 0
        request.sampling.logprobs = request.logprobs
    elif top:
        raise bad_param("top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true")
    messages = parse_messages(body.get("messages"))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise bad_param("chat_template_kwargs", "must be an object")
    taken = [name for name in TEMPLATE_OWN_ARGS if name in kwargs]
    if taken:
        raise bad_param("chat_template_kwargs", f"may not set {', '.join(taken)}: the server passes the template "
                        f"its own ({', '.join(TEMPLATE_OWN_ARGS)})")
    kwargs = {**kwargs, "add_generation_prompt": bool(body.get("add_generation_prompt", True))}
    return request, messages, kwargs


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_body(body: Any) -> None:
    """What JSON parses but nothing downstream takes, refused naming the top-level field: a string that is not
    valid Unicode (a lone UTF-16 surrogate such as \\ud800, which JSON escapes allow and no tokenizer or encoder
    accepts), and nesting deeper than MAX_BODY_DEPTH levels. One pass over the body, without recursion (bounded by
    check_value_count)."""
    if not isinstance(body, dict):
        return
    for key, value in body.items():
        param = key if _valid_text(key) else None
        stack: list[tuple[Any, int]] = [(key, 0), (value, 1)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, str):
                if not _valid_text(item):
                    raise ApiError(400, f"{param or 'a field name'}: a string holds a lone UTF-16 surrogate "
                                   "(such as \\ud800): not valid Unicode", param)
            elif isinstance(item, dict | list):
                if depth >= MAX_BODY_DEPTH:
                    raise ApiError(400, f"{param or 'a field name'}: nested deeper than {MAX_BODY_DEPTH} levels",
                                   param)
                children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
                if set(map(type, children)) <= SCALARS:  # token ids: one pass in C, nothing to look into
                    continue
                stack.extend((child, depth + 1) for child in children if type(child) not in SCALARS)


def check_value_count(data: bytes) -> None:
    """A body of more than MAX_BODY_VALUES strings, objects and lists, more than MAX_BODY_ITEMS items in all
    (numbers included: each list element and object member) or a number of more than MAX_NUMBER_DIGITS digits in a
    row is refused before it is parsed, from its bytes, in
    passes in C (~0.05 s for 8 MiB on a slow 2-core box, where parsing and checking such a body took seconds).
    UTF-8 puts no quote, backslash, bracket or comma byte inside a multi-byte character, so once the escapes are
    gone every quote left opens or closes a string, and the brackets and commas outside strings are the JSON's."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    strings = plain.count(b'"') // 2
    if strings > MAX_BODY_VALUES:
        raise ApiError(400, VALUES_OVER)
    if over_limit(plain, strings) is None:  # even counting the brackets, commas and digits inside strings
        return
    why = over_limit(b"".join(plain.split(b'"')[::2]), strings)  # at most MAX_BODY_VALUES strings to split out
    if why is not None:
        raise ApiError(400, why)


def over_limit(json_bytes: bytes, strings: int) -> str | None:
    """Which limit the body's strings and the brackets, commas and digit runs of json_bytes exceed, if any."""
    if strings + json_bytes.count(b"[") + json_bytes.count(b"{") > MAX_BODY_VALUES:
        return VALUES_OVER
    if json_bytes.count(b",") >= MAX_BODY_ITEMS:
        return ITEMS_OVER
    return NUMBER_OVER if b"\x00" * (MAX_NUMBER_DIGITS + 1) in json_bytes.translate(DIGIT_RUNS) else None


def text_bytes(value: Any) -> int:
    """UTF-8 bytes of every string value in a JSON value (keys aside): what a template can put in the prompt."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) if item.isascii() else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def _valid_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_common(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> ApiRequest:
    for name in REFUSED_PARAMS:
        if body.get(name):
            raise bad_param(name, f"{name} is not supported by this server")
    for name, default in DEFAULT_ONLY.items():
        if body.get(name) is not None and body[name] != default:
            raise bad_param(name, f"{name} is not supported by this server"
                                  f"{'' if default is None else f' (only {json.dumps(default)})'}")
    if body.get("suffix"):
        raise bad_param("suffix", "suffix (fill-in-the-middle) is not supported: the model has no fill-in-the-middle "
                                  "tokens")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_param("model", "must be a string")
    sampling = common_pb2.SamplingParams()
    request = ApiRequest(model or None, sampling, stream=read_bool(body, "stream"))  # "" serves the default model
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
        sampling.seed = read_int(body, "seed", -INT64, INT64) % 2**64  # a signed 64-bit seed, as the wire's uint64
    if body.get("priority") is not None:
        sampling.priority = read_int(body, "priority", -(2**31) + 1, 2**31)
    sampling.ignore_eos = read_bool(body, "ignore_eos")
    sampling.include_stop_str_in_output = read_bool(body, "include_stop_str_in_output")
    sampling.stop.extend(read_stop(body.get("stop")))
    sampling.stop_token_ids.extend(read_stop_token_ids(body.get("stop_token_ids") or []))
    request.constraint_param = read_constraint(body, sampling)
    read_logit_bias(body.get("logit_bias"), sampling)
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise bad_param("cache_salt", "must be a non-empty string if provided")
        request.cache_salt = salt
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_param("stream_options", "must be an object")
        if options and not request.stream:
            raise bad_param("stream_options", "Stream options can only be defined when `stream=True`.")
        request.include_usage = bool(options.get("include_usage"))
    return request


def read_constraint(body: dict[str, Any], sampling: common_pb2.SamplingParams) -> str | None:
    """OpenAI's response_format (text, json_object, json_schema) or vLLM's structured_outputs (or its guided_*
    parameters): at most one of them, into sampling.structured_outputs; the parameter that gave it, if any."""
    fmt = read_response_format(body.get("response_format"))
    given = {name: body[name] for name in ("structured_outputs", *GUIDED_PARAMS) if body.get(name) is not None}
    if fmt is not None and given:
        raise bad_param("response_format", f"give either response_format or {', '.join(given)}, not both")
    if len(given) > 1:
        raise bad_param(next(iter(given)), f"give one of {', '.join(given)}")
    if fmt is not None:
        sampling.structured_outputs.CopyFrom(fmt)
        return "response_format"
    if "structured_outputs" in given:
        sampling.structured_outputs.CopyFrom(read_structured_outputs(given["structured_outputs"]))
        return "structured_outputs"
    if given:
        name, value = next(iter(given.items()))
        sampling.structured_outputs.CopyFrom(structured_field(GUIDED_PARAMS[name], value, name))
        return name
    return None


def read_response_format(value: Any) -> common_pb2.StructuredOutputs | None:
    """{"type": "text"} is plain text (None); json_object and json_schema ({"json_schema": {"name": ..., "schema":
    {...}, "strict": ...}}) constrain the output (always strictly: the output matches the schema)."""
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_param("response_format", "must be an object with a string type")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return common_pb2.StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad_param("response_format", f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
        raise bad_param("response_format", "json_schema must be an object whose schema is a JSON schema object")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_param("response_format", "json_schema.strict must be a boolean")
    return common_pb2.StructuredOutputs(json=json.dumps(spec.get("schema", {})))


def read_structured_outputs(value: Any) -> common_pb2.StructuredOutputs:
    if not isinstance(value, dict):
        raise bad_param("structured_outputs", "must be an object")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = [k for k in given if k not in STRUCTURED_KEYS]
    if unknown:
        raise bad_param("structured_outputs", f"unknown key {unknown[0]!r}; one of {', '.join(STRUCTURED_KEYS)}")
    if len(given) != 1:
        raise bad_param("structured_outputs", f"give exactly one of {', '.join(STRUCTURED_KEYS)}")
    key, item = next(iter(given.items()))
    return structured_field(key, item, "structured_outputs")


def structured_field(key: str, value: Any, param: str) -> common_pb2.StructuredOutputs:
    if key == "json":
        if isinstance(value, dict | bool):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise bad_param(param, "json must be a JSON schema (an object, or its JSON text)")
        return common_pb2.StructuredOutputs(json=value)
    if key == "json_object":
        return common_pb2.StructuredOutputs(json_object=value is True)
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_param(param, "choice must be a non-empty list of strings")
        return common_pb2.StructuredOutputs(choice=value)
    if not isinstance(value, str) or not value:
        raise bad_param(param, f"{key} must be a non-empty string")
    return common_pb2.StructuredOutputs(regex=value) if key == "regex" else common_pb2.StructuredOutputs(grammar=value)


def read_logit_bias(value: Any, sampling: common_pb2.SamplingParams) -> None:
    """OpenAI's logit_bias: {"token id": bias}; ids and ranges are checked by validation (naming the id)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise bad_param("logit_bias", "must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS:  # before any per-entry work
        raise bad_param("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(value)}")
    for key, bias in value.items():
        if not is_token_id_key(key):
            raise bad_param("logit_bias", f"key {key[:32]!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_param("logit_bias", f"the bias of token {key} must be a number, got {bias!r}")
        sampling.logit_bias[int(key)] = float(bias)


def is_token_id_key(key: str) -> bool:
    """Whether a JSON object key is a token id: ASCII digits below 2**32 (str.isdigit also takes digits such as
    '²' that int() refuses, and int() refuses more than 4300 digits: both were a 500)."""
    return key.isascii() and key.isdigit() and len(key) <= len(str(UINT32)) and int(key) < UINT32


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
    if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:  # before any per-item work
        raise bad_param("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    if isinstance(value, list) and types_of(value) <= {str}:
        return value
    raise bad_param("stop", "must be a string or a list of strings")


def read_stop_token_ids(value: Any) -> list[int]:
    if isinstance(value, list) and len(value) > MAX_STOP_TOKEN_IDS:  # before any per-item work
        raise bad_param("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(value)}")
    return read_token_ids(value, "stop_token_ids")


def types_of(items: list[Any]) -> set[type]:
    """The exact types in a list, in one pass in C (bool is not int here, as JSON has it): a list of millions of
    token ids is checked in milliseconds, where a generator of isinstance calls held the event loop for seconds."""
    return set(map(type, items))


def read_token_ids(value: Any, name: str, max_model_len: int | None = None) -> list[int]:
    if isinstance(value, list) and max_model_len is not None and len(value) >= max_model_len:
        raise bad_param(name, f"{len(value)} tokens; max_model_len is {max_model_len}")
    if not isinstance(value, list) or not types_of(value) <= {int}:
        raise bad_param(name, "must be a list of token ids")
    if value and (min(value) < 0 or max(value) >= UINT32):
        raise bad_param(name, "token ids must be non-negative")
    return value


def parse_prompts(value: Any, max_model_len: int | None = None) -> list[Prompt]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise bad_param("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    kinds = types_of(value)
    if kinds <= {str}:
        return list(value)
    if not kinds & {str, list}:  # token ids, whose count comes first
        return [read_token_ids(value, "prompt", max_model_len)]
    if kinds <= {list}:
        return [read_token_ids(p, "prompt", max_model_len) for p in value]
    raise bad_param("prompt", "must be a string, a list of token ids, or a list of either")


def parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "must be a non-empty list of messages")
    messages = []
    answerable: set[str] = set()  # ids of the tool calls the messages so far leave open to a `tool` message
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_param("messages", f"messages[{i}] must be an object with a string role")
        check_tool_calls(message.get("tool_calls"), i)
        if message["role"] == "tool":
            check_tool_answer(message.get("tool_call_id"), i, answerable)
        else:
            answerable = call_ids(message.get("tool_calls")) if message["role"] == "assistant" else set()
        messages.append({**message, "content": message_text(message.get("content"), i)})
    return messages


def call_ids(calls: list[Any] | None) -> set[str]:
    """The ids of an assistant message's tool calls (checked by check_tool_calls)."""
    return {call["id"] for call in calls or [] if isinstance(call.get("id"), str)}


def check_tool_answer(call_id: Any, index: int, answerable: set[str]) -> None:
    """A `tool` message answers one of the tool calls of the assistant message it follows (only `tool` messages
    between them), as OpenAI requires; a template would otherwise render a result no call asked for."""
    where = f"messages[{index}].tool_call_id"
    if not isinstance(call_id, str):
        raise bad_param("messages", f"{where} is required: a message with role 'tool' answers a tool call by its id")
    if call_id not in answerable:
        raise bad_param("messages", f"{where} {call_id[:64]!r} is not the id of a tool call in the assistant "
                        "message before it (a message with role 'tool' must answer a preceding message's "
                        "tool_calls)")


def check_tool_calls(calls: Any, index: int) -> None:
    """An assistant message's earlier tool calls, as OpenAI writes them: a list of objects whose `function` is an
    object with a string `name` and `arguments` as JSON text (or an object, as vLLM takes them). A malformed one
    used to reach the tool-call rendering and fail there (HTTP 500) or render as `null` calls."""
    if calls is None:
        return
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise bad_param("messages", f"{where} must be a list of tool calls")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_param("messages", f"{where}[{j}] must be an object whose function has a string name")
        if not isinstance(function.get("arguments", ""), str | dict):
            raise bad_param("messages", f"{where}[{j}].function.arguments must be a JSON string")


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
