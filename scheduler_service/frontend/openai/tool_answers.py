"""A chat call's answers under tools (tools.py): whole messages carrying `tool_calls`, or stream chunks as OpenAI's
tool_call deltas. A named function streams its arguments as they come; `required` and `auto` answers stream their
calls as they are read (tool_stream.py)."""

from __future__ import annotations

from typing import Any

from scheduler_service.frontend.openai.tool_stream import ToolStream
from scheduler_service.frontend.openai.tools import ToolCall, ToolCallParser, ToolChoice, ToolRequest, calls_from_output


class ToolAnswers:
    def __init__(self, tools: ToolRequest, parser: ToolCallParser) -> None:
        self.tools = tools
        self.parser = parser
        self._streams: dict[int, ToolStream] = {}
        self._named: dict[int, ToolCall] = {}

    def read(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish reason) of a finished answer; an answer cut short (length) stays text."""
        if finish_reason != "stop":
            return text, [], finish_reason
        content, calls = calls_from_output(text, self.tools, self.parser)
        forced = self.tools.choice is ToolChoice.NAMED  # OpenAI: a forced function finishes `stop`
        return content, calls, ("tool_calls" if calls and not forced else finish_reason)

    def message(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A built chat choice with its text read as content and tool calls."""
        content, calls, reason = self.read(choice["message"]["content"], choice["finish_reason"])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.body() for call in calls]
        return {**choice, "message": message, "finish_reason": reason}

    def chunk_choice(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any] | None:
        """The stream choice for this response of choice `index`; None when it has nothing to send yet."""
        if self.tools.choice is ToolChoice.NAMED:
            return self._named_chunk(index, text, finish_reason)
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = ToolStream(self.tools, self.parser)
        content, parts = stream.feed(text)
        if finish_reason is not None:
            content += stream.finish()
            if stream.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        delta: dict[str, Any] = {"content": content} if content else {}
        if parts:
            delta["tool_calls"] = parts
        if not delta and finish_reason is None:
            return None
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    def _named_chunk(self, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
        call = self._named.get(index)
        if call is None:
            call = self._named[index] = ToolCall(self.tools.named, "")
            part: dict[str, Any] = {"index": 0, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": text}}
        else:
            part = {"index": 0, "function": {"arguments": text}}
        delta = {"tool_calls": [part]} if text or "id" in part else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
