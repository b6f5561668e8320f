"""What a request's output must match (vLLM's StructuredOutputsParams), and OpenAI's strict mode as a schema
transform. Checked when the request is built; compiling it is grammar.py's."""
from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one field set (vLLM's names)."""
    json: str | None = None          # a JSON schema, serialized
    json_object: bool = False        # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None       # a Lark grammar, or llama.cpp's GBNF

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json, json_object, regex, choice "
                                      f"and grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")


_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")  # a schema each
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")                        # a list of schemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")         # name -> schema


def closed(schema):
    """The schema with every object that does not say otherwise closed to the properties it names
    (additionalProperties false): what OpenAI's strict mode asks of a schema. A new value."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
