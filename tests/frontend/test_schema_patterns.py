"""A JSON schema's regular expressions are bounded before any work: xgrammar expands a schema pattern's repetitions
(its regex and grammar kinds do not), so a 47-byte schema, {"type": "string", "pattern": "[a-z]{1,10000}"}, held
the engine core's one compile thread 47 s on the default model's 2k vocabulary, and `.{1,3000}` as propertyNames
took 18 s of the api server's checking thread (shared with tokenizing) and 17 s more to compile."""

from __future__ import annotations

import json

import pytest

from protos.pagedserve.v1 import common_pb2
from scheduler_service.frontend.constraints import FIELD, MAX_PATTERN_REPEATS, constraint_from, pattern_repeats
from scheduler_service.frontend.validation import InvalidArgument


def schema_params(schema: object) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams()
    p.structured_outputs.json = json.dumps(schema)
    return p


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "[a-z]{1,10000}"},
    {"type": "object", "propertyNames": {"pattern": ".{1,3000}"}},
    {"type": "object", "patternProperties": {"^\\w{600}$": {"type": "integer"}}},
    {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "[0-9]{1,200}"} for i in range(3)}},
    {"type": "string", "pattern": "((.{1,8}){1,8}){1,8}"},
    {"type": "array", "items": {"type": "string", "pattern": "(?:\\d{,5000})"}},
])
def test_a_schema_whose_patterns_expand_too_far_is_refused_naming_the_field(schema: object) -> None:
    with pytest.raises(InvalidArgument) as caught:
        constraint_from(schema_params(schema))
    assert caught.value.field == f"{FIELD}.json"


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    {"type": "string", "pattern": "^([a-z0-9-]{1,63}\\.){1,8}[a-z]{2,6}$"},
    {"type": "string", "pattern": "^(abc){1,1000}\\{x\\}[^\\]]{3}$"},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "[A-F0-9]{32}"}}, "required": ["id"]},
    {"type": "string", "maxLength": 100000},
])
def test_common_patterns_pass(schema: object) -> None:
    assert constraint_from(schema_params(schema)) is not None


def test_repeats_are_the_bounds_around_each_class_multiplied_and_summed() -> None:
    assert pattern_repeats("(.{1,16}){16}") == (256, 2)
    assert pattern_repeats("[a-z]{2,}x*\\w+") == (3, 1)
    assert pattern_repeats("(abc){1,100}") == (0, 0)  # literals are not expanded at any cost
    assert pattern_repeats(f".{{1,{MAX_PATTERN_REPEATS + 1}}}")[0] > MAX_PATTERN_REPEATS
