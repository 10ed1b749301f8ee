"""Structured-output constraints as xgrammar grammars: what both tiers share. The api servers check a request's
constraint with it (off their event loop) before any work; the engine core compiles it for its executor's tokenizer
(engine/grammar.py).

xgrammar is imported inside the functions: it imports torch, so a process pays for it (about 3 s and 250 MB once)
only when its first constrained request arrives, on a worker thread.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from scheduler_service.core.request import Constraint, ConstraintKind

if TYPE_CHECKING:
    import xgrammar

MAX_CONSTRAINT_BYTES = 64 * 1024
"""The largest schema, regex, grammar or list of choices a request may carry (UTF-8 bytes)."""
MAX_CHOICES = 1024
SOURCE_PREFIX = re.compile(r"^\[[^\]]*\] [^ ]+:\d+: ")

FIELD_NAMES = {ConstraintKind.JSON_SCHEMA: "json", ConstraintKind.JSON_OBJECT: "json_object",
               ConstraintKind.REGEX: "regex", ConstraintKind.CHOICE: "choice", ConstraintKind.GRAMMAR: "grammar"}


class InvalidConstraint(ValueError):
    """The constraint cannot be compiled; the message says why (the caller names the field)."""


def json_schema_text(schema: Any) -> str:
    """A schema given as a JSON value, as compact text (the compile cache's key; property order is kept)."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the choices (JSON string escapes are xgrammar's EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def to_grammar(constraint: Constraint) -> xgrammar.Grammar:
    """The constraint as an xgrammar Grammar; InvalidConstraint if its spec is not one. Blocks (run it off the
    event loop). JSON is compact (no free whitespace), so a model cannot pad its output forever."""
    import xgrammar

    kind, spec = constraint.kind, constraint.spec
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return xgrammar.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind is ConstraintKind.JSON_SCHEMA:
            return xgrammar.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind is ConstraintKind.REGEX:
            return xgrammar.Grammar.from_regex(spec)
        if kind is ConstraintKind.CHOICE:
            return xgrammar.Grammar.from_ebnf(choice_grammar(json.loads(spec)))
        return xgrammar.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidConstraint(clean_message(str(e))) from None


def clean_message(text: str) -> str:
    """xgrammar's error's first line without its time and C++ source location prefix."""
    lines = text.strip().splitlines()
    return SOURCE_PREFIX.sub("", lines[0]) if lines else "invalid"
