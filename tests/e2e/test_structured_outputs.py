"""Structured outputs (#30) through real processes: a torch executor on the default model with a small KV cache (so
that a batch of constrained requests preempts by recompute) and a scheduler serving gRPC and HTTP, driven by the
official `openai` client.

Every output that finishes `stop` under a strict json_schema parses and validates against its schema with the
`jsonschema` package (formats: ipv4 and uuid checked, date as an annotation, jsonschema's default), for 50 distinct
schemas, with n = 1 and n = 2 and under preemption; regex and choice outputs match; a constraint that allows every
text leaves greedy output unchanged; bad constraints and logit_bias values are refused naming the field. Tool calls
with tool_choice named and required give arguments valid for the function's schema, streamed and not; `tool`
messages are accepted in the conversation.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from client.lib import PagedServeClient
from protos.pagedserve.v1 import common_pb2, generation_pb2
from scheduler_service.structured import MAX_CONSTRAINT_BYTES
from tests.support.procs import Stack, run, running_http_stack, wait_until

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

MODEL = "default-model-v2"
# 64 blocks of 16 tokens for up to 100 sequences of ~21 prompt + 27-118 output tokens (2 blocks each, 3-9 by the
# end): recompute preemption (a chat prompt with the tools system message is ~500 tokens). The 50 calls reach the
# scheduler spread out (each compiles its grammar first); even were every output only 27 tokens, arriving in any order
# at random steps up to 40 apart they preempted in each of 60 orders (scripts/arrival_spread.py --prompts 21,...,21
# (50) --max-tokens 27 --blocks 64).
EXECUTOR = ["--device", "cpu", "--num-gpu-blocks", "64", "--num-cpu-blocks", "0"]
MAX_TOKENS = 160
FORMATS = jsonschema.FormatChecker(formats=["ipv4", "uuid"])
LEAVES: list[dict[str, Any]] = [
    {"type": "integer", "minimum": 0, "maximum": 999},
    {"type": "boolean"},
    {"type": "string", "maxLength": 6},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "string", "format": "ipv4"},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 3}]},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 3},
    {"type": "string", "format": "uuid"},
    {"type": "null"},
    {"type": "string", "format": "date"},
]


def leaf(k: int) -> dict[str, Any]:
    return json.loads(json.dumps(LEAVES[k % len(LEAVES)]))


def obj(props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schema(i: int) -> dict[str, Any]:
    """The i-th schema: 1-3 leaf properties, and by i a nested object, an array of objects, an anyOf of objects,
    some properties optional."""
    props = {f"p{i}_{j}": leaf(i + 3 * j) for j in range(1 + i % 3)}
    if i % 3 == 0:
        props["child"] = obj({"c": leaf(i + 1), "d": leaf(i + 2)}, ["c", "d"])
    if i % 5 == 1:
        props["rows"] = {"type": "array", "items": obj({"x": leaf(i)}, ["x"]), "minItems": 1, "maxItems": 2}
    if i % 7 == 2:
        props["either"] = {"anyOf": [obj({"a": leaf(i)}, ["a"]), obj({"b": leaf(i + 4)}, ["b"])]}
    names = list(props)
    return obj(props, names if i % 2 == 0 else names[:1])


SCHEMAS = [schema(i) for i in range(50)]
DEAD_END = 'root ::= "a" r\nr ::= r'
"""A grammar whose first token is forced ("a") and after which no token (not even EOS) is allowed."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    args = ["--tool-call-parser", "hermes"]
    with running_http_stack(tmp_path_factory.mktemp("structured"), EXECUTOR, args) as s:
        yield s, f"{s.http_url}/v1"


@pytest.fixture
async def client(stack: tuple[Stack, str]) -> AsyncIterator[Any]:
    async with openai.AsyncOpenAI(base_url=stack[1], api_key="unused", max_retries=0) as c:
        yield c


def response_format(s: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": s, "strict": True}}


def check_json(text: str, s: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), s, format_checker=FORMATS)


def test_the_schemas_are_distinct_and_cover_the_kinds() -> None:
    texts = {json.dumps(s, sort_keys=True) for s in SCHEMAS}
    assert len(texts) == 50
    joined = "".join(texts)
    for word in ('"anyOf"', '"enum"', '"format"', '"items"', '"required"', '"child"'):
        assert word in joined


@pytest.mark.parametrize("n", [1, 2])
async def test_fifty_json_schemas_validate_also_with_n2_and_under_preemption(client: Any, stack: tuple[Stack, str],
                                                                             n: int) -> None:
    async def one(i: int, s: dict[str, Any]) -> list[Any]:
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe item {i} as JSON."}], n=n, seed=i,
            temperature=0.7 if n > 1 else 0, max_tokens=MAX_TOKENS, response_format=response_format(s))
        return list(r.choices)

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))
    for s, choices in zip(SCHEMAS, results, strict=True):
        assert len(choices) == n
        for choice in choices:
            assert choice.finish_reason == "stop", (s, choice.message.content)
            check_json(choice.message.content, s)
    assert stack[0].metrics().get("vllm:num_preemptions_total", 0) > 0, "the small KV cache should have preempted"


async def test_streamed_json_schema_chunks_join_into_a_valid_document(client: Any) -> None:
    s = SCHEMAS[3]
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON please."}], max_tokens=MAX_TOKENS, temperature=0,
        response_format=response_format(s), stream=True)
    parts, reasons = [], []
    async for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    check_json("".join(parts), s)


async def test_json_object_regex_and_choice_outputs_match(client: Any) -> None:
    obj_out = await client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if obj_out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj_out.choices[0].text), dict)
    pattern = r"[0-9]{3}-[0-9]{4}( ext [0-9]{1,3})?"
    phones = await client.completions.create(model=MODEL, prompt="Phone:", max_tokens=30, temperature=1.0, n=4,
                                             seed=5, extra_body={"structured_outputs": {"regex": pattern}})
    for c in phones.choices:
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text), c.text
    choices = ["yes", "no", "maybe so"]
    picked = await client.completions.create(model=MODEL, prompt="Well?", max_tokens=10, temperature=1.0, n=4, seed=6,
                                             extra_body={"guided_choice": choices})
    assert {c.text for c in picked.choices} <= set(choices)
    grammar = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
    expr = await client.completions.create(model=MODEL, prompt="Sum:", max_tokens=40, temperature=0.8, seed=7,
                                           extra_body={"structured_outputs": {"grammar": grammar}})
    if expr.choices[0].finish_reason == "stop":
        assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", expr.choices[0].text)


async def test_a_constraint_allowing_every_text_leaves_greedy_output_unchanged(client: Any) -> None:
    prompts = ["Once upon a time", "The little dog", "User: What is the capital of France?\nAssistant:"]
    for prompt in prompts:
        free = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        held = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"structured_outputs": {"regex": r"[\s\S]*"}})
        assert held.choices[0].text == free.choices[0].text
        assert held.choices[0].finish_reason == free.choices[0].finish_reason


async def test_logit_bias_steers_greedy_output(client: Any, stack: tuple[Stack, str]) -> None:
    async with PagedServeClient(stack[0].address) as c:
        ids, _, _, _ = await run(c, prompt="Once upon a time", max_tokens=4, temperature=0.0)
    banned = {str(ids[0]): -100}
    first = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0,
                                            logit_bias=banned, logprobs=1)
    assert first.choices[0].logprobs.tokens[0] != (await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=1, temperature=0, logprobs=1)).choices[0].logprobs.tokens[0]


@pytest.mark.parametrize(("extra", "says", "param"), [
    ({"response_format": response_format({"type": "strin"})}, "structured_outputs.json", "response_format"),
    ({"response_format": response_format({"type": "object", "properties": {"a": {"$ref": "#/nope"}}})},
     "structured_outputs.json", "response_format"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar", "structured_outputs"),
    ({"guided_grammar": "root ::= missing"}, "structured_outputs.grammar", "guided_grammar"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice[1]", "structured_outputs"),
    ({"structured_outputs": {"regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}}, f"at most {MAX_CONSTRAINT_BYTES} bytes",
     "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    # languages that are empty (xgrammar compiles them; they used to run and fail as HTTP 500 "generation failed")
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs.grammar: the grammar allows no output",
     "structured_outputs"),
    ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs.regex: the grammar allows no "
     "output", "structured_outputs"),
    # a dead end after the forced first token: the grammar's fault, not the server's (was HTTP 500)
    ({"structured_outputs": {"grammar": DEAD_END}}, "structured_outputs.grammar: the output's grammar allows no "
     "token here", "structured_outputs"),
    ({"structured_outputs": {"grammar": DEAD_END}, "n": 3, "temperature": 1.0}, "structured_outputs.grammar: the "
     "output's grammar allows no token here", "structured_outputs"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias[5]", "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias[999999]", "logit_bias"),
])
async def test_bad_constraints_and_biases_are_refused_naming_the_field(client: Any, stack: tuple[Stack, str],
                                                                       extra: dict[str, Any], says: str,
                                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    assert says in caught.value.body["message"] and caught.value.body["param"] == param
    await asyncio.to_thread(wait_until, stack[0].idle, 30)  # what the refused request held is freed


async def test_grpc_refuses_two_kinds_and_bad_grammars_with_invalid_argument(stack: tuple[Stack, str]) -> None:
    async with PagedServeClient(stack[0].address) as c:
        for so, says in ((common_pb2.StructuredOutputs(regex="a", grammar='root ::= "a"'), "exactly one"),
                         (common_pb2.StructuredOutputs(json="{not json"), "not valid JSON"),
                         # json.loads recursed out (UNKNOWN); 300 levels compiled for ~9 s on the engine core
                         (common_pb2.StructuredOutputs(json="[" * 30000 + "]" * 30000), "nested deeper than"),
                         (common_pb2.StructuredOutputs(json='{"type": "array", "items": ' * 300 + "{}" + "}" * 300),
                          "nested deeper than"),
                         (common_pb2.StructuredOutputs(grammar="root ::= ("), "structured_outputs.grammar"),
                         (common_pb2.StructuredOutputs(grammar="root ::= root"), "the grammar allows no output"),
                         (common_pb2.StructuredOutputs(grammar=DEAD_END), "allows no token here")):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await run(c, prompt="x", max_tokens=4, structured_outputs=so)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in (caught.value.details() or "")
        _, text, reason, _ = await run(c, prompt="x", max_tokens=8, temperature=0.0,
                                       structured_outputs=common_pb2.StructuredOutputs(choice=["alpha", "beta"]))
        assert text in ("alpha", "beta") and reason == generation_pb2.FINISH_REASON_STOP


# ---- tool calling ----------------------------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
BOOK: dict[str, Any] = {"type": "function", "function": {"name": "book", "parameters": {
    "type": "object", "properties": {
        "guest": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                   "vip": {"type": "boolean"}},
                  "required": ["name", "vip"], "additionalProperties": False},
        "nights": {"type": "array", "items": {"type": "string", "enum": ["mon", "tue", "wed"]}, "minItems": 1,
                   "maxItems": 3}},
    "required": ["guest", "nights"], "additionalProperties": False}}}
# a third schema (nested object, array of enums) for the streamed calls; strict, as the client's helpers want them
STRICT_TOOLS = [{**t, "function": {**t["function"], "strict": True}} for t in [*TOOLS, BOOK]]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in [*TOOLS, BOOK]}
CONVERSATION = [{"role": "user", "content": "What is the weather in Oslo?"}]


def check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


@pytest.mark.parametrize("choice", ["named", "required"])
async def test_forced_tool_calls_have_valid_arguments(client: Any, choice: str) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    for seed in range(3):
        r = await client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, seed=seed,
                                                 temperature=0.8, tool_choice=tool_choice, max_tokens=400,
                                                 parallel_tool_calls=seed != 0)
        message = r.choices[0].message
        assert message.content is None
        check_calls(message.tool_calls)
        assert r.choices[0].finish_reason == ("stop" if choice == "named" else "tool_calls")
        if choice == "named":
            assert [c.function.name for c in message.tool_calls] == ["add"]


@pytest.mark.parametrize("choice", ["named", "required"])
async def test_forced_tool_calls_stream_as_tool_call_deltas(client: Any, choice: str) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    stream = await client.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS, temperature=0,
                                                  tool_choice=tool_choice, max_tokens=MAX_TOKENS, stream=True,
                                                  parallel_tool_calls=False)
    calls: dict[int, dict[str, str]] = {}
    reasons = []
    async for chunk in stream:
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    assert reasons[-1] == ("stop" if choice == "named" else "tool_calls")
    assert len(calls) == 1 and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA_OF[calls[0]["name"]])


async def stream_with_helper(client: Any, **body: Any) -> tuple[str, dict[int, tuple[str, str]], str]:
    """A chat answer through the openai client's streaming helper: its content, each call's (name, arguments as the
    concatenated argument deltas), in index order as the events came, and the finish reason."""
    content, order = "", []
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    async with client.chat.completions.stream(model=MODEL, messages=CONVERSATION, **body) as stream:
        async for event in stream:
            if event.type == "content.delta":
                assert not names, "content after a call started"
                content += event.delta
            elif event.type == "tool_calls.function.arguments.delta":
                names[event.index] = event.name
                arguments[event.index] = arguments.get(event.index, "") + event.arguments_delta
                order.append(event.index)
        final = await stream.get_final_completion()
    assert order == sorted(order), "calls come one after another, indexes increasing"
    for call, (_, args) in zip(final.choices[0].message.tool_calls or [], sorted(arguments.items()), strict=True):
        assert call.function.arguments == args and call.id  # the helper's own assembly of the deltas
    return content, {i: (names[i], arguments[i]) for i in sorted(arguments)}, final.choices[0].finish_reason


@pytest.mark.parametrize(("choice", "parallel", "seed", "num_tools"), [
    ("required", True, 2, 2),  # eight parallel calls of two functions
    ("required", False, 1, 3),
    ("book", False, 0, 3),  # a named function with a nested schema
])
async def test_tool_calls_stream_the_non_streamed_arguments_exactly(client: Any, choice: str, parallel: bool,
                                                                    seed: int, num_tools: int) -> None:
    """Seeded sampling makes the streamed answer the same tokens as the whole one."""
    tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    body = {"tool_choice": tool_choice, "seed": seed, "temperature": 0.8, "max_tokens": 400 if num_tools == 2 else 200,
            "parallel_tool_calls": parallel, "tools": STRICT_TOOLS[:num_tools]}
    whole = await client.chat.completions.create(model=MODEL, messages=CONVERSATION, **body)
    calls = whole.choices[0].message.tool_calls
    check_calls(calls)
    assert len(calls) == (8 if parallel else 1)
    assert len({c.function.name for c in calls}) == (2 if parallel else 1), "the calls cover both schemas"
    expected = {i: (c.function.name, c.function.arguments) for i, c in enumerate(calls)}
    streamed = await stream_with_helper(client, **body)
    assert streamed == ("", expected, "tool_calls" if choice == "required" else "stop")


async def test_auto_streams_text_as_content_then_each_call_as_generated(client: Any) -> None:
    """A hermes-format answer forced by a regex (the small model writes none of its own): text, then two calls."""
    call = (r'<tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call> '
            r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,5}", "unit": "c"\}\}'
            r'</tool_call>')
    body = {"tool_choice": "auto", "temperature": 0, "max_tokens": 200, "tools": STRICT_TOOLS,
            "extra_body": {"structured_outputs": {"regex": r"Sure\. " + call}}}
    whole = await client.chat.completions.create(model=MODEL, messages=CONVERSATION, **body)
    message = whole.choices[0].message
    assert message.content == "Sure." and whole.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls)
    content, calls, reason = await stream_with_helper(client, **body)
    assert content == "Sure. " and reason == "tool_calls"
    assert calls == {i: (c.function.name, c.function.arguments) for i, c in enumerate(message.tool_calls)}
    assert [name for name, _ in calls.values()] == ["add", "get_weather"]


async def test_tool_messages_and_auto_are_accepted(client: Any) -> None:
    history = [*CONVERSATION,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    r = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="auto",
                                             max_tokens=12, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
    else:
        assert isinstance(choice.message.content, str)
    none = await client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                                max_tokens=4, temperature=0)
    assert none.choices[0].message.tool_calls is None


# ---- echo ----------------------------------------------------------------------------------------------------


async def test_echo_puts_the_prompt_before_each_choice_streamed_and_not(client: Any) -> None:
    prompt = "Once upon a time"
    plain = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = await client.completions.create(model=MODEL, prompt=[prompt, "The dog"], max_tokens=6, temperature=0,
                                             echo=True, n=2)
    texts = [c.text for c in sorted(echoed.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] == prompt + plain.choices[0].text and texts[2].startswith("The dog")
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                             stream=True)
    assert "".join([c.choices[0].text async for c in stream if c.choices]) == prompt + plain.choices[0].text
    # echo with logprobs (the prompt tokens' logprobs first): tests/e2e/test_prompt_logprobs.py
