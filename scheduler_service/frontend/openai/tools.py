"""Tool calling in /v1/chat/completions: the request's tools and tool_choice, the constraint that enforces a required
or named call, and the parsers that find calls in a model's free text (--tool-call-parser, as vLLM's).

- `none`: the tools are not offered and the answer is text.
- `auto`: the model may call tools; a parser (hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  llama3_json: `{"name": ..., "parameters": {...}}`, several joined by `;`) reads the calls from its text.
- `required`: the output is constrained to a JSON array of `{"name": one of the tools, "parameters": that tool's
  schema}` (one item unless parallel_tool_calls, then at most MAX_PARALLEL_CALLS), as vLLM does, and read as the
  calls.
- a named function: the output is constrained to that function's parameters schema, and is its arguments.
"""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from scheduler_service.frontend.openai.call_scanner import CallScanner
from scheduler_service.frontend.openai.errors import bad_param

MAX_PARALLEL_CALLS = 8
"""The most calls one `required` answer may hold (with parallel_tool_calls; one without)."""


class ToolCallParser(enum.Enum):
    """--tool-call-parser: how `auto` reads calls from the model's text (none: `auto` is refused)."""

    NONE = "none"
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tools (OpenAI's function tools) and how they must be used."""

    tools: list[dict[str, Any]]
    choice: ToolChoice
    named: str = ""
    parallel: bool = True
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # function name -> parameters schema

    def constraint_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match (required, named), None when the text is free."""
        if self.choice is ToolChoice.NAMED:
            return self.schemas[self.named]
        if self.choice is not ToolChoice.REQUIRED:
            return None
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in self.schemas.items()]
        return {"type": "array", "items": {"anyOf": items}, "minItems": 1,
                "maxItems": MAX_PARALLEL_CALLS if self.parallel else 1}

    def template_tools(self) -> list[dict[str, Any]] | None:
        return None if self.choice is ToolChoice.NONE else self.tools


def read_tools(body: dict[str, Any], parser: ToolCallParser) -> ToolRequest | None:
    """The body's tools, tool_choice and parallel_tool_calls; None without tools (tool_choice then must be absent
    or none). Every refusal names its parameter."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise bad_param("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise bad_param("tools", "must be a list of function tools")
    schemas = {name: schema for name, schema in (read_tool(t, i) for i, t in enumerate(tools))}
    if len(schemas) != len(tools):
        raise bad_param("tools", "function names must be unique")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "must be a boolean")
    request = ToolRequest(tools, ToolChoice.AUTO, parallel=parallel, schemas=schemas)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or name not in schemas:
            raise bad_param("tool_choice", f"a named choice is {{'type': 'function', 'function': {{'name': one of "
                                           f"{', '.join(schemas)}}}}}")
        request.choice, request.named = ToolChoice.NAMED, str(name)
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise bad_param("tool_choice", "must be 'none', 'auto', 'required' or a named function")
        request.choice = ToolChoice(choice)
    if request.choice is ToolChoice.AUTO and parser is ToolCallParser.NONE:
        raise bad_param("tool_choice", "'auto' needs the server started with --tool-call-parser (hermes or "
                                       "llama3_json); use 'required' or a named function")
    return request


def read_tool(tool: Any, index: int) -> tuple[str, dict[str, Any]]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
        raise bad_param("tools", f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}")
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise bad_param("tools", f"tools[{index}].function.name must be 1-64 letters, digits, '_', '.' or '-'")
    schema = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(schema, dict):
        raise bad_param("tools", f"tools[{index}].function.parameters must be a JSON schema object")
    return name, schema


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def calls_from_output(text: str, tools: ToolRequest, parser: ToolCallParser) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished answer. A forced call's answer (named or `required`) that is not whole
    JSON, cut by one of the client's stop strings, is text: arguments are always whole JSON."""
    if tools.choice in (ToolChoice.NAMED, ToolChoice.REQUIRED) and not is_json(text):
        return text, []
    if tools.choice is ToolChoice.NAMED:
        return None, [ToolCall(tools.named, text)]
    if tools.choice is ToolChoice.REQUIRED:
        return None, required_calls(text)
    if tools.choice is ToolChoice.NONE:
        return text, []
    return parse_calls(text, parser, set(tools.schemas))


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def required_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` answer (whole JSON); each one's arguments are its `parameters` as the model wrote
    them (the text the stream sends in fragments: call_scanner.py)."""
    scanner = CallScanner(2, ("parameters",))
    scanner.feed(text)
    return [ToolCall(c.name, scanner.arguments(c)) for c in scanner.calls if c.name is not None]


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_calls(text: str, parser: ToolCallParser, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """The calls the parser finds (to functions that exist) and the text around them; no call: the text."""
    if parser is ToolCallParser.HERMES:
        calls = [call for m in HERMES.finditer(text) if (call := json_call(m.group(1), "arguments", names))]
        if not calls:
            return text, []
        rest = HERMES.sub(lambda m: "" if json_call(m.group(1), "arguments", names) else m.group(0), text).strip()
        return (rest or None), calls
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = [call for part in body.split(";") if (call := json_call(part, "parameters", names))]
    if not calls or len(calls) != len([p for p in body.split(";") if p.strip()]):
        return text, []
    return None, calls


def json_call(text: str, arguments_key: str, names: set[str]) -> ToolCall | None:
    try:
        item = json.loads(text)
    except ValueError:
        return None
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    scanner = CallScanner(1, tuple(dict.fromkeys((arguments_key, "arguments"))))  # the model's own text of them
    scanner.feed(text)
    return ToolCall(item["name"], scanner.arguments(scanner.calls[0]))


def tool_messages(messages: list[dict[str, Any]], template_source: str) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools: an assistant's tool_calls become hermes text in its
    content and a `tool` message becomes a user message holding a <tool_response>. A template that mentions
    tool_calls gets them as they are."""
    if "tool_calls" in template_source:
        return messages
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(f"<tool_call>\n{json.dumps(call_summary(c))}\n</tool_call>" for c in m["tool_calls"])
            out.append({**m, "content": (m.get("content") or "") + calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    return out


def call_summary(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    return {"name": function.get("name"), "arguments": function.get("arguments")}


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """The tools as a system message, for a template that does not render `tools` (hermes' wording)."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to assist with the user query. The functions:\n<tools>\n"
            f"{specs}\n</tools>\nFor each call, return a JSON object with the function name and arguments within "
            '<tool_call></tool_call> tags: <tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
            "</tool_call>")
