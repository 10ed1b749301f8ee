"""A request's structured-output constraint, checked before any work: the cheap checks (one kind, size, JSON)
on the event loop, the grammar itself (xgrammar parses it) on a worker thread. Every refusal names the field."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Executor

from protos.pagedserve.v1 import common_pb2
from scheduler_service.core.request import Constraint, ConstraintKind
from scheduler_service.frontend.validation import InvalidArgument
from scheduler_service.structured import (
    FIELD_NAMES,
    MAX_CHOICES,
    MAX_CONSTRAINT_BYTES,
    InvalidConstraint,
    json_schema_text,
    to_grammar,
)

FIELD = "sampling.structured_outputs"
MAX_SCHEMA_DEPTH = 72
"""JSON nesting a schema may have. The HTTP api's bodies are held to 64 levels (MAX_BODY_DEPTH); the gRPC api's
schema is text, and deeper ones recursed out of json.loads (an UNKNOWN status) or took xgrammar seconds to compile
(300 levels: ~9 s), holding up every later constrained request on the engine core's compile thread. 72: room for
the levels a required tool choice wraps around a parameters schema that the body limit let through."""


def constraint_from(p: common_pb2.SamplingParams) -> Constraint | None:
    """The constraint the request's sampling.structured_outputs states, None without one."""
    if not p.HasField("structured_outputs"):
        return None
    s = p.structured_outputs
    given = [k for k, on in ((ConstraintKind.JSON_SCHEMA, bool(s.json)), (ConstraintKind.JSON_OBJECT, s.json_object),
                             (ConstraintKind.REGEX, bool(s.regex)), (ConstraintKind.CHOICE, bool(s.choice)),
                             (ConstraintKind.GRAMMAR, bool(s.grammar))) if on]
    if len(given) != 1:
        names = ", ".join(FIELD_NAMES[k] for k in given) or "none"
        raise InvalidArgument(FIELD, f"set exactly one of json, json_object, regex, choice, grammar (got {names})")
    kind = given[0]
    field = f"{FIELD}.{FIELD_NAMES[kind]}"
    if kind is ConstraintKind.JSON_OBJECT:
        return Constraint(kind)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, checked_choices(list(s.choice), field))
    spec = s.json if kind is ConstraintKind.JSON_SCHEMA else s.regex if kind is ConstraintKind.REGEX else s.grammar
    check_size(spec, field)
    if kind is ConstraintKind.JSON_SCHEMA:
        spec = json_schema_text(parsed_schema(spec, field))
    return Constraint(kind, spec)


def check_size(text: str, field: str) -> None:
    size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidArgument(field, f"{size} bytes; at most {MAX_CONSTRAINT_BYTES} bytes")


def parsed_schema(text: str, field: str) -> object:
    try:
        schema = json.loads(text)
    except RecursionError:
        raise InvalidArgument(field, f"nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
    except ValueError as e:
        raise InvalidArgument(field, f"not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidArgument(field, f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
    if depth_exceeds(schema, MAX_SCHEMA_DEPTH):
        raise InvalidArgument(field, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


def depth_exceeds(value: object, limit: int) -> bool:
    """Whether a JSON value nests objects and arrays deeper than `limit` levels (without recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def checked_choices(choices: list[str], field: str) -> str:
    if len(choices) > MAX_CHOICES:
        raise InvalidArgument(field, f"{len(choices)} choices; at most {MAX_CHOICES}")
    for i, c in enumerate(choices):
        if not c:
            raise InvalidArgument(f"{field}[{i}]", "a choice is a non-empty string")
    spec = json.dumps(choices, ensure_ascii=False)
    check_size(spec, field)
    return spec


async def check_grammar(constraint: Constraint, pool: Executor) -> None:
    """InvalidArgument naming the field if xgrammar cannot make a grammar of the constraint (on `pool`)."""
    try:
        await asyncio.get_running_loop().run_in_executor(pool, to_grammar, constraint)
    except InvalidConstraint as e:
        raise InvalidArgument(f"{FIELD}.{FIELD_NAMES[constraint.kind]}", str(e)) from None
