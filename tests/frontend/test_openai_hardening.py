"""What the OpenAI HTTP API refuses before any work (#27), without servers: bodies JSON parses but nothing
downstream takes, template arguments a client may not replace, templates failing on their input, error types."""

from __future__ import annotations

import json

import pytest

from scheduler_service.frontend.openai.chat import ChatTemplate
from scheduler_service.frontend.openai.connections import connection_cap
from scheduler_service.frontend.openai.errors import ApiError
from scheduler_service.frontend.openai.protocol import MAX_BODY_DEPTH, check_body, parse_chat, text_bytes


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
