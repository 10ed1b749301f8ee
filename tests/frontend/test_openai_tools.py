"""Tool calling's request reading, constraint and parsers (#30), without processes."""

from __future__ import annotations

import json
import random
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


CALLED = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
    {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}


def test_tool_messages_answering_the_calls_before_them_are_accepted() -> None:
    answers = [{"role": "tool", "tool_call_id": "c2", "content": "noon"},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    _, messages, _ = parse_chat({"messages": [*MESSAGES, CALLED, *answers, {"role": "user", "content": "and?"}]})
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool", "user"]


@pytest.mark.parametrize(("history", "index", "why"), [
    ([{"role": "tool", "tool_call_id": "c1", "content": "sunny"}], 1, "is not the id"),  # no call before it
    ([CALLED, {"role": "tool", "tool_call_id": "c3", "content": "x"}], 2, "is not the id"),  # an unknown id
    ([CALLED, {"role": "tool", "content": "x"}], 2, "is required"),  # no id
    ([CALLED, {"role": "tool", "tool_call_id": 1, "content": "x"}], 2, "is required"),  # not a string
    # the call was answered before a user message: a later tool message answers nothing
    ([CALLED, {"role": "tool", "tool_call_id": "c1", "content": "x"}, {"role": "user", "content": "ok"},
      {"role": "tool", "tool_call_id": "c2", "content": "y"}], 4, "is not the id"),
    ([{"role": "assistant", "content": "no calls"}, {"role": "tool", "tool_call_id": "c1", "content": "x"}], 2,
     "is not the id"),
])
def test_a_tool_message_that_answers_no_preceding_call_is_refused(history: list[dict[str, Any]], index: int,
                                                                   why: str) -> None:
    with pytest.raises(ApiError) as caught:
        parse_chat({"messages": [*MESSAGES, *history]})
    assert caught.value.status == 400 and caught.value.param == "messages"
    assert f"messages[{index}].tool_call_id" in caught.value.message and why in caught.value.message


def test_tool_messages_are_rendered_as_text_for_a_template_without_tools() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out = tool_messages(messages, "{{ messages }}")
    assert "<tool_call>" in out[1]["content"] and out[2] == {"role": "user",
                                                            "content": "<tool_response>\nsunny\n</tool_response>"}
    assert tool_messages(messages, "{% for m in messages %}{{ m.tool_calls }}{% endfor %}") == messages


# ---- streamed calls for required and auto (tool_stream.py) ----------------------------------------------------

ARGUMENTS = [
    '{"city": "Oslo", "unit": "c"}',
    '{ "city" : "a \\"quoted\\" {brace} [x], y" ,\n  "unit": "f" }',
    '{"zone": "UTC", "nested": {"list": [1, {"deep": [true, null]}], "s": "\\u00e9\\\\"}}',
    '{"zone":"Ω unicode 日本"}',
    '{}',
]


def pieces(text: str, seed: int) -> list[str]:
    """The text cut at random places (seed 0: one character at a time)."""
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = 1 if seed == 0 else rng.randint(1, 7)
        out.append(text[i:i + n])
        i += n
    return out


def stream_all(answers: ToolAnswers, text: str, seed: int) -> tuple[str, dict[int, dict[str, str]], list[Any], str]:
    """Content, calls by index (id, name, arguments concatenated), every tool-call part, the last finish reason."""
    content, parts, reason = "", [], None
    calls: dict[int, dict[str, str]] = {}
    chunks = pieces(text, seed)
    for i, piece in enumerate(chunks):
        choice = answers.chunk_choice(0, piece, "stop" if i == len(chunks) - 1 else None)
        if choice is None:
            continue
        reason = choice["finish_reason"]
        content += choice["delta"].get("content", "")
        for part in choice["delta"].get("tool_calls", []):
            parts.append(part)
            call = calls.setdefault(part["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] += part.get("id", "")
            call["name"] += part.get("function", {}).get("name", "")
            call["arguments"] += part["function"]["arguments"]
    return content, calls, parts, reason or ""


def whole(answers: ToolAnswers, text: str) -> dict[str, Any]:
    return answers.message({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"})


def check_stream_equals_whole(choice: Any, parser: ToolCallParser, text: str, names: list[str]) -> str:
    """Streamed in several ways, the calls are the non-streamed ones, argument text for argument text; the first
    part of each call carries its index, id, type and name, and indexes increase. Returns the streamed content."""
    api = chat(tool_choice=choice)
    message = whole(ToolAnswers(api.tools, parser), text)["message"]
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert [name for name, _ in expected] == names
    contents = set()
    for seed in range(4):
        content, calls, parts, reason = stream_all(ToolAnswers(api.tools, parser), text, seed)
        assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
        assert sorted(calls) == list(range(len(names)))
        firsts = [p for p in parts if "id" in p]
        assert [p["index"] for p in firsts] == list(range(len(names)))
        assert all(p["type"] == "function" and p["function"]["name"] and p["id"].startswith("call_") for p in firsts)
        assert all(parts.index(f) == min(i for i, p in enumerate(parts) if p["index"] == f["index"]) for f in firsts)
        assert reason == "tool_calls"
        contents.add(content)
    assert len(contents) == 1
    return contents.pop()


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_required_calls_stream_their_arguments_as_generated(arguments: str) -> None:
    text = f'[{{"name": "get_weather", "parameters": {arguments}}}, {{"parameters": {arguments}, "name": "get_time"}}]'
    assert check_stream_equals_whole("required", ToolCallParser.HERMES, text, ["get_weather", "get_time"]) == ""
    for piece_count in (3, 20):  # arguments arrive while they are generated, not when the call is complete
        api = chat(tool_choice="required")
        answers = ToolAnswers(api.tools, ToolCallParser.HERMES)
        cut = text.index(arguments) + len(arguments) * piece_count // 40 + 1
        first = answers.chunk_choice(0, text[:cut], None)
        assert first is not None and first["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
        assert arguments.startswith(first["delta"]["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_hermes_auto_streams_content_then_calls(arguments: str) -> None:
    text = (f'Let me check <b>that</b>.\n<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n'
            f'</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {arguments}}}</tool_call>')
    content = check_stream_equals_whole("auto", ToolCallParser.HERMES, text, ["get_weather", "get_time"])
    assert content == "Let me check <b>that</b>.\n"  # the whitespace between and after the calls is not sent


def test_hermes_auto_sends_a_call_to_an_unknown_function_as_content() -> None:
    text = 'a <tool_call>{"name": "rm", "arguments": {}}</tool_call> <tool_call>{"name": "get_time", ' \
           '"arguments": {"zone": "UTC"}}</tool_call>'
    content = check_stream_equals_whole("auto", ToolCallParser.HERMES, text, ["get_time"])
    assert content == 'a <tool_call>{"name": "rm", "arguments": {}}</tool_call> '


@pytest.mark.parametrize("arguments", ARGUMENTS)
def test_llama3_json_auto_streams_calls(arguments: str) -> None:
    text = f'<|python_tag|>{{"name": "get_time", "parameters": {arguments}}}; {{"name": "get_weather", ' \
           f'"parameters": {arguments}}}'
    assert check_stream_equals_whole("auto", ToolCallParser.LLAMA3_JSON, text, ["get_time", "get_weather"]) == ""


def test_llama3_json_auto_text_streams_as_content() -> None:
    api = chat(tool_choice="auto")
    for text in ("Just an answer {not a call}", '{"name": "rm", "parameters": {}}', "  <|pyt"):
        content, calls, _, reason = stream_all(ToolAnswers(api.tools, ToolCallParser.LLAMA3_JSON), text, 0)
        assert (content, calls, reason) == (text, {}, "stop")
        assert whole(ToolAnswers(api.tools, ToolCallParser.LLAMA3_JSON), text)["message"]["content"] == text


@pytest.mark.parametrize("text", ['[{"name', '[{"name": "get_weather", "parameters": {"city"', '['])
def test_a_required_answer_cut_by_a_stop_string_is_text_whole_and_streamed(text: str) -> None:
    """A client's stop string can end a constrained answer before its JSON does: the answer is its text (it was a
    500, "not JSON"), and the stream sends that text as content when no call was read before the cut."""
    api = chat(tool_choice="required")
    message = whole(ToolAnswers(api.tools, ToolCallParser.HERMES), text)
    assert (message["message"], message["finish_reason"]) == ({"role": "assistant", "content": text}, "stop")
    if '"get_weather"' not in text:
        for seed in range(3):
            assert stream_all(ToolAnswers(api.tools, ToolCallParser.HERMES), text, seed) == (text, {}, [], "stop")


def test_a_named_answer_cut_by_a_stop_string_is_text_not_arguments() -> None:
    api = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = whole(ToolAnswers(api.tools, ToolCallParser.NONE), '{"city"')
    assert (message["message"], message["finish_reason"]) == ({"role": "assistant", "content": '{"city"'}, "stop")
    done = whole(ToolAnswers(api.tools, ToolCallParser.NONE), '{"city": "Oslo"}')
    assert done["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'


@pytest.mark.parametrize(("parser", "text"), [
    (ToolCallParser.HERMES, 'Hi <tool_call>{"ci\\qty": 1}</tool_call>'),
    (ToolCallParser.HERMES, '<tool_call>{"ar\\x": {}, "name": "get_time"}</tool_call>'),
    (ToolCallParser.LLAMA3_JSON, '{"ci\\qty": 1}'),
    (ToolCallParser.LLAMA3_JSON, '{"\\u12": {}, "name": "get_time"}'),
])
def test_an_object_key_that_is_not_a_json_string_streams_as_content(parser: ToolCallParser, text: str) -> None:
    """A model may write a key with an invalid escape: the object is no call, so the answer is text whole and
    streamed (the stream's scanner raised JSONDecodeError, which cut the HTTP stream without [DONE])."""
    api = chat(tool_choice="auto")
    assert whole(ToolAnswers(api.tools, parser), text)["message"] == {"role": "assistant", "content": text}
    for seed in range(4):
        assert stream_all(ToolAnswers(api.tools, parser), text, seed) == (text, {}, [], "stop")


@pytest.mark.parametrize("parser", [ToolCallParser.HERMES, ToolCallParser.LLAMA3_JSON])
def test_a_bad_key_after_a_sent_call_name_ends_the_stream_normally(parser: ToolCallParser) -> None:
    """Once a call's name has been sent, a bad key after it cannot take the call back (as for a cut answer): the
    stream goes on to its end with the call."""
    body = '{"name": "get_time", "\\u12": {}}'
    text = f"<tool_call>{body}</tool_call>" if parser is ToolCallParser.HERMES else body
    api = chat(tool_choice="auto")
    for seed in range(4):
        _, calls, _, reason = stream_all(ToolAnswers(api.tools, parser), text, seed)
        assert [c["name"] for c in calls.values()] == ["get_time"] and reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize(("param", "value"), [("stop", ["}"]), ("stop", '"'), ("stop_token_ids", [7])])
def test_a_stop_with_a_forced_tool_choice_is_refused_naming_it(choice: Any, param: str, value: Any) -> None:
    """A stop could cut the calls' JSON: streamed, arguments that are not JSON were already sent (a `required`
    answer even finished `tool_calls`), so the request is refused; `auto` and `none` take stops as before."""
    with pytest.raises(ApiError) as caught:
        chat(tool_choice=choice, **{param: value})
    assert caught.value.param == param and "required or named tool_choice" in caught.value.message
    for free in ("auto", "none"):
        assert list(chat(tool_choice=free, stop=["}"]).sampling.stop) == ["}"]
