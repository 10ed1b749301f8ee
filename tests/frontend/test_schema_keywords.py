"""JSON schema keywords xgrammar accepts and ignores are refused, naming where they are, instead of constraining
outputs that can break them; the rest, and property names that spell a keyword, pass. Each refused case is shown
against xgrammar itself: the grammar it makes accepts an output that breaks the schema (if xgrammar learns to
enforce one, its case fails here, and the keyword can be allowed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from scheduler_service.frontend.constraints import parsed_schema, unenforced_keyword
from scheduler_service.frontend.validation import InvalidArgument

OBJECT: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
IGNORED = [  # (schema, where the refusal points, an output xgrammar allows that breaks the schema)
    ({"type": "string", "not": {"const": "x"}}, "not", '"x"'),
    ({"not": {}}, "not", "1"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains", "[2]"),
    ({**OBJECT, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, "if", '{"a":1}'),
    ({**OBJECT, "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a":1}'),
    ({**OBJECT, "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", '{"a":1}'),
    ({"type": "integer", "allOf": [{"minimum": 3}]}, "allOf", "1"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"type": "integer", "maximum": 5}]}, "allOf", "9"),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "/properties/tags/uniqueItems", '{"tags":[1,1]}'),
    ({"$defs": {"T": {"not": {"type": "null"}}}, "$ref": "#/$defs/T"}, "/$defs/T/not", "null"),
    ({"anyOf": [{"type": "string"}, {"type": "integer", "not": {"const": 1}}]}, "/anyOf/1/not", "1"),
]


@pytest.mark.parametrize(("schema", "where", "breaking"), IGNORED)
def test_an_ignored_keyword_is_refused_naming_where_it_is(schema: dict[str, Any], where: str, breaking: str) -> None:
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, breaking), "xgrammar enforces this now: allow the keyword"
    assert unenforced_keyword(schema) == where
    with pytest.raises(InvalidArgument) as caught:
        parsed_schema(json.dumps(schema), "sampling.structured_outputs.json")
    assert caught.value.field == "sampling.structured_outputs.json" and f"{where} is not supported" in str(caught.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"if": {"type": "string"}, "not": {"type": "integer"},
                                      "contains": {"type": "array", "uniqueItems": False}}, "required": ["if"]},
    {"$defs": {"F": {"type": "integer", "minimum": 3}},
     "properties": {"x": {"allOf": [{"$ref": "#/$defs/F"}], "description": "one schema, annotated"}}},
    {**OBJECT, "dependentRequired": {}, "examples": [{"not": 1, "if": 2}], "default": {"allOf": [1, 2]}},
    {"type": "string", "format": "email", "minLength": 3, "pattern": "^a"},
    {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    True,
])
def test_supported_schemas_and_keyword_named_properties_pass(schema: Any) -> None:
    assert unenforced_keyword(schema) is None
    parsed_schema(json.dumps(schema), "sampling.structured_outputs.json")
