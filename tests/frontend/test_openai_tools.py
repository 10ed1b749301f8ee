"""Tool calling's request reading, constraint and parsers (#30), without processes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from scheduler_service.frontend.openai.errors import ApiError
from scheduler_service.frontend.openai.protocol import parse_chat
from scheduler_service.frontend.openai.tool_answers import ToolAnswers
from scheduler_service.frontend.openai.tools import ToolCallParser, ToolChoice, parse_calls, tool_messages

WEATHER: dict[str, Any] = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
MESSAGES = [{"role": "user", "content": "weather?"}]


def chat(**body: Any) -> Any:
    return parse_chat({"messages": MESSAGES, "tools": [WEATHER, TIME], **body}, ToolCallParser.HERMES)[0]


def test_named_choice_constrains_to_the_functions_parameters() -> None:
    api = chat(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert api.tools.choice is ToolChoice.NAMED
    assert json.loads(api.sampling.structured_outputs.json) == TIME["function"]["parameters"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_constrains_to_an_array_of_calls(parallel: bool) -> None:
    api = chat(tool_choice="required", parallel_tool_calls=parallel)
    schema = json.loads(api.sampling.structured_outputs.json)
    ok = [{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {"zone": "UTC"}}]
    jsonschema.validate(ok[:1], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"zone": "UTC"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    if parallel:
        jsonschema.validate(ok, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(ok * 5, schema)  # at most MAX_PARALLEL_CALLS
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(ok, schema)


def test_auto_and_none_leave_the_text_free() -> None:
    assert not chat(tool_choice="auto").sampling.HasField("structured_outputs")
    assert chat(tool_choice="none").tools.template_tools() is None


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "x"}]}, "functions"),
])
def test_bad_tool_requests_name_the_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as caught:
        chat(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_auto_needs_a_parser_and_tool_choice_needs_tools() -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": MESSAGES, "tools": [WEATHER]})
    assert caught.value.param == "tool_choice"
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": MESSAGES, "tool_choice": "required"})
    assert caught.value.param == "tool_choice"


def test_hermes_and_llama3_parsers_find_calls_to_known_functions() -> None:
    names = {"get_weather", "get_time"}
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>')
    content, calls = parse_calls(text, ToolCallParser.HERMES, names)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "UTC"})]
    assert parse_calls("<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>", ToolCallParser.HERMES,
                       names)[1] == []
    content, calls = parse_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                 '{"name": "get_weather", "parameters": {"city": "Rome"}}',
                                 ToolCallParser.LLAMA3_JSON, names)
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_calls("just text", ToolCallParser.LLAMA3_JSON, names) == ("just text", [])


def test_answers_become_tool_calls_whole_and_streamed() -> None:
    api = chat(tool_choice="required")
    answers = ToolAnswers(api.tools, ToolCallParser.HERMES)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    message = answers.message({"index": 0, "message": {"role": "assistant", "content": text},
                               "finish_reason": "stop"})
    assert message["finish_reason"] == "tool_calls" and message["message"]["content"] is None
    assert json.loads(message["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert answers.chunk_choice(0, text[:10], None) is None
    last = answers.chunk_choice(0, text[10:], "stop")
    assert last is not None and last["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    named = ToolAnswers(chat(tool_choice={"type": "function", "function": {"name": "get_time"}}).tools,
                        ToolCallParser.NONE)
    first, second = named.chunk_choice(1, '{"zone"', None), named.chunk_choice(1, ': "UTC"}', "stop")
    assert first is not None and second is not None
    assert first["delta"]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert second["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": ': "UTC"}'}}
    assert second["finish_reason"] == "stop"


def test_tool_messages_are_rendered_as_text_for_a_template_without_tools() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = tool_messages(messages, "{{ messages }}")
    assert "<tool_call>" in out[1]["content"] and out[2] == {"role": "user",
                                                            "content": "<tool_response>\nsunny\n</tool_response>"}
    assert tool_messages(messages, "{% for m in messages %}{{ m.tool_calls }}{% endfor %}") == messages
