"""What a request asks (specserve/structured_output/params.py): exactly one kind of guide, and OpenAI's strict
mode as closed schemas."""
import ast
import json
from pathlib import Path

import pytest

from specserve.errors import InvalidRequestError
from specserve.structured_output import params
from specserve.structured_output.params import StructuredOutputsParams as Guide
from specserve.structured_output.params import closed


@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ("a",)}, "exactly one"),
    ({"choice": ()}, "non-empty"),
])
def test_bad_guides_are_clear_errors(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        Guide(**fields)


@pytest.mark.parametrize("schema,expected", [
    ({"type": "string"}, {"type": "string"}),
    ({"properties": {"a": {"type": "integer"}}},
     {"properties": {"a": {"type": "integer"}}, "additionalProperties": False}),
    ({"properties": {}, "additionalProperties": True}, {"properties": {}, "additionalProperties": True}),
    ({"properties": {"p": {"properties": {"q": {}}}}},
     {"properties": {"p": {"properties": {"q": {}}, "additionalProperties": False}}, "additionalProperties": False}),
    ({"type": "array", "items": {"properties": {}}},
     {"type": "array", "items": {"properties": {}, "additionalProperties": False}}),
    ({"anyOf": [{"properties": {}}, {"type": "null"}]},
     {"anyOf": [{"properties": {}, "additionalProperties": False}, {"type": "null"}]}),
    ({"$defs": {"x": {"properties": {}}}, "$ref": "#/$defs/x"},
     {"$defs": {"x": {"properties": {}, "additionalProperties": False}}, "$ref": "#/$defs/x"}),
    ({"properties": {"properties": {"type": "string"}}},  # a property named "properties" is not a schema keyword
     {"properties": {"properties": {"type": "string"}}, "additionalProperties": False}),
])
def test_strict_mode_closes_objects(schema, expected):
    before = json.dumps(schema)
    assert closed(schema) == expected
    assert json.dumps(schema) == before  # the input is not changed


def test_the_request_side_needs_neither_the_grammar_library_nor_torch():
    tree = ast.parse(Path(params.__file__).read_text())
    imported = {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert {name.split(".")[0] for name in imported} <= {"__future__", "dataclasses", "specserve"}
