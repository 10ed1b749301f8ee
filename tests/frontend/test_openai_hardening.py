"""What the OpenAI HTTP API refuses before any work (#27), without servers: bodies JSON parses but nothing
downstream takes, template arguments a client may not replace, templates failing on their input, error types."""

from __future__ import annotations

import json
from typing import Any

import pytest

from scheduler_service.frontend.openai.chat import ChatTemplate
from scheduler_service.frontend.openai.connections import connection_cap
from scheduler_service.frontend.openai.errors import ApiError
from scheduler_service.frontend.openai.protocol import (
    MAX_BODY_DEPTH,
    MAX_BODY_ITEMS,
    MAX_BODY_VALUES,
    MAX_NUMBER_DIGITS,
    check_body,
    check_value_count,
    parse_chat,
    parse_completion,
    parse_prompts,
    text_bytes,
)


@pytest.mark.parametrize(("text", "param"), [
    ('{"prompt": "\\ud800"}', "prompt"),
    ('{"prompt": ["ok", [1, 2], "x\\udc00y"]}', "prompt"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}]}', "messages"),
    ('{"chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs"),
    ('{"\\ud800": 1}', None),
])
def test_a_lone_surrogate_anywhere_is_refused_naming_the_top_level_field(text: str, param: str | None) -> None:
    with pytest.raises(ApiError) as caught:
        check_body(json.loads(text))
    error = caught.value
    assert error.status == 400 and error.param == param and "lone UTF-16 surrogate" in error.message
    json.dumps(error.body()).encode()  # the error itself is valid Unicode


def test_deep_nesting_is_refused_and_valid_text_passes() -> None:
    deep = json.loads('{"stop": ' + "[" * MAX_BODY_DEPTH + "]" * MAX_BODY_DEPTH + "}")
    with pytest.raises(ApiError) as caught:
        check_body(deep)
    assert caught.value.param == "stop" and f"deeper than {MAX_BODY_DEPTH}" in caught.value.message
    check_body(json.loads('{"stop": ' + "[" * (MAX_BODY_DEPTH - 2) + "]" * (MAX_BODY_DEPTH - 2) + "}"))
    check_body({"prompt": "日本語 and emoji \U0001f600", "messages": [{"content": "\u00e9"}], "n": 2})


@pytest.mark.parametrize("body", [
    {"prompt": [[1]] * (MAX_BODY_VALUES + 1)},
    {"messages": [{"role": "user"}] * (MAX_BODY_VALUES // 2)},
    {"logit_bias": {str(i): 1 for i in range(MAX_BODY_VALUES + 1)}},
    {f"unknown{i}": 1 for i in range(MAX_BODY_VALUES + 1)},
    {"stop": ['a\\"[{'] * (MAX_BODY_VALUES + 1)},
])
def test_a_body_of_too_many_values_is_refused_from_its_bytes(body: dict[str, Any]) -> None:
    """Millions of `[1]` lists, messages or keys used to be parsed and walked one by one on the event loop (seconds
    for every other stream of the api server) before any count limit was checked."""
    with pytest.raises(ApiError) as caught:
        check_value_count(json.dumps(body).encode())
    assert caught.value.status == 400
    assert f"holds more than {MAX_BODY_VALUES} strings, objects and lists" in caught.value.message


@pytest.mark.parametrize("body", [
    {"prompt": [1] * (MAX_BODY_ITEMS + 1)},
    {"prompt": "x", "unknown": [0.5] * (MAX_BODY_ITEMS + 1)},  # an unknown field: it was parsed, then ignored (200)
    {"prompt": [[1] * (MAX_BODY_ITEMS // 4)] * 5},
])
def test_a_body_of_too_many_items_is_refused_from_its_bytes(body: dict[str, Any]) -> None:
    """A list of millions of numbers (not counted among the values) was parsed on the event loop: 6 - 8 s for 60 MiB."""
    with pytest.raises(ApiError) as caught:
        check_value_count(json.dumps(body).encode())
    assert f"more than {MAX_BODY_ITEMS} items" in caught.value.message


@pytest.mark.parametrize("number", ["2." + "4" * (MAX_NUMBER_DIGITS + 1), "1" * (MAX_NUMBER_DIGITS + 1),
                                    "0." + "0" * 60 + "1"])
def test_a_number_of_too_many_digits_is_refused_from_its_bytes(number: str) -> None:
    """json.loads converts a long decimal exactly (~60 us for 767 digits): 60 MiB of them, under the item limit,
    held every other stream 5.8 s."""
    with pytest.raises(ApiError) as caught:
        check_value_count(f'{{"prompt": "x", "x": [1, {number}]}}'.encode())
    assert f"more than {MAX_NUMBER_DIGITS} digits" in caught.value.message


def test_the_largest_bodies_clients_send_are_within_the_value_limit() -> None:
    """Also with brackets, quotes and backslashes inside the strings, which open no object, list or string."""
    code = 'def f(x): return {"a": [x, "\\"", \'[{\']}\n' * 200_000  # 8 MB of brackets in one string
    for body in ({"prompt": [[1, 2, 3]] * 10_000},  # as many prompts as the api server has open calls
                 {"prompt": [1] * 1_000_000, "logit_bias": {str(i): 1 for i in range(1024)}},
                 {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}] * 10_000},
                 {"prompt": code}, {"prompt": [code[:100]] * 10_000},
                 {"prompt": [1] * (MAX_BODY_ITEMS - 100), "stop": [", , ,"] * 16},  # commas in strings: not items
                 {"prompt": "9" * 10_000, "seed": 2**64 - 1, "temperature": 0.1 + 0.2, "top_p": 5e-324}):
        data = json.dumps(body).encode()
        check_value_count(data)
        check_body(json.loads(data))
    assert parse_prompts([[1, 2], [3]]) == [[1, 2], [3]] and parse_prompts([1, 2]) == [[1, 2]]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"stop_token_ids": [1] * 256 + [True]}, "stop_token_ids", "at most 256 ids, got 257"),
    ({"stop": ["a"] * 16 + [7]}, "stop", "at most 16 stop strings, got 17"),
    ({"logit_bias": {**{str(i): 1 for i in range(1024)}, "not an id": 1}}, "logit_bias", "at most 1024 token ids"),
])
def test_a_count_limit_is_checked_before_the_items(body: dict[str, Any], param: str, message: str) -> None:
    """Each list's count is refused before any per-item work (the bad item at the end is never reached): a body of
    millions of stop ids or logit_bias keys was read item by item, then refused for its count."""
    with pytest.raises(ApiError) as caught:
        parse_completion({"prompt": "x", **body})
    assert caught.value.param == param and message in caught.value.message


@pytest.mark.parametrize("prompt", [[1, True], [1, -1], [1, 2**32], [[1], [2.0]], [[1], "x"], [1.5]])
def test_token_id_prompts_of_the_wrong_type_or_range_are_refused(prompt: list[Any]) -> None:
    with pytest.raises(ApiError) as caught:
        parse_prompts(prompt)
    assert caught.value.param == "prompt"


def test_text_bytes_counts_every_string_value_in_utf8() -> None:
    assert text_bytes([{"role": "user", "content": "日本"}, {"x": ["ab", 3, None]}]) == 4 + 6 + 2


@pytest.mark.parametrize("name", ["messages", "bos_token", "eos_token", "raise_exception", "strftime_now"])
def test_chat_template_kwargs_may_not_replace_the_templates_own_arguments(name: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {name: "x"}})
    assert caught.value.status == 400 and caught.value.param == "chat_template_kwargs"
    assert name in caught.value.message
    _, _, kwargs = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                               "chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs == {"enable_thinking": False, "add_generation_prompt": True}


def test_a_template_failing_on_the_input_is_400_naming_messages() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m['content'] + m.get('suffix', '') }}{% endfor %}", {})
    assert template.render([{"role": "user", "content": "a", "suffix": "b"}], {}) == "ab"
    with pytest.raises(ApiError) as caught:
        template.render([{"role": "user", "content": "a", "suffix": 1}], {})
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert "TypeError" in caught.value.message
    with_tokens = ChatTemplate("{{ bos_token }}{{ messages | length }}", {"bos_token": "<s>"})
    assert with_tokens.render([{}], {"bos_token": "evil", "messages": []}) == "<s>1", "the server's own win"


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (408, "invalid_request_error"),
                                              (413, "invalid_request_error"), (415, "invalid_request_error"),
                                              (401, "invalid_request_error"), (500, "server_error")])
def test_every_client_error_status_is_an_invalid_request_error(status: int, kind: str) -> None:
    assert ApiError(status, "x").body()["error"]["type"] == kind


def test_the_connection_cap_leaves_half_the_open_files_to_the_rest_of_the_process() -> None:
    assert connection_cap(4096, 1_048_576) == 4096
    assert connection_cap(4096, 1024) == 512
    assert connection_cap(100, 1024) == 100
    assert connection_cap(4096, 20) == 16


def test_a_token_id_prompt_as_long_as_max_model_len_is_refused_before_its_ids_are_read() -> None:
    """The length comes first (a bad id at the end is never reached); each prompt of a batch alike."""
    for prompt in ([1] * 99 + [True], [[1], [1] * 99 + [-1]]):
        with pytest.raises(ApiError) as caught:
            parse_completion({"prompt": prompt}, max_model_len=100)
        assert caught.value.param == "prompt" and caught.value.message == "prompt: 100 tokens; max_model_len is 100"
    assert parse_completion({"prompt": [1] * 99}, max_model_len=100).prompts == [[1] * 99]
