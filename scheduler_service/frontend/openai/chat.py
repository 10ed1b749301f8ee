"""Chat templates: the model's Jinja2 template rendered in a sandbox, with the variables transformers passes."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from scheduler_service.frontend.openai.errors import ApiError, bad_param


def raise_exception(message: str) -> None:
    raise TemplateError(message)


def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
           sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template and the special-token strings it may use (bos_token, eos_token, ...)."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ApiError(500, f"the model's chat template does not compile: {e}") from None
        self.special_tokens = special_tokens

    def render(self, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> str:
        """The conversation as text; any failure of the template on these inputs is the request's (400)."""
        variables = {**kwargs, **self.special_tokens, "messages": messages}  # the server's own win
        try:
            return self._template.render(variables)
        except TemplateError as e:
            raise bad_param("messages", f"the chat template refused the messages: {e}") from None
        except Exception as e:  # a template over unexpected input: TypeError, KeyError, RecursionError, ...
            raise bad_param("messages", f"the chat template failed on these messages: {type(e).__name__}: {e}"
                            ) from None
