"""Shared by the structured-output tests: a guide of each kind, and a grammar's next-token mask as booleans.
(Not a test module.)"""
import json

import torch

from specserve import SamplingParams
from specserve.structured_output.masks import words
from specserve.structured_output.params import StructuredOutputsParams as Guide

SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 6}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
GUIDES = [Guide(json=json.dumps(SCHEMA)), Guide(regex=r"[a-g]+( [a-g]+)*\."), Guide(choice=("tea", "coffee", "the")),
          Guide(grammar='start: "x" num ("," num)*\nnum: /[0-9]{1,3}/'), Guide(json_object=True)]


def guided(i: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=0, structured_outputs=GUIDES[i % len(GUIDES)], **kw)


def allowed(grammar, vocab: int) -> torch.Tensor:
    """The grammar's next-token mask as [V] booleans."""
    row = torch.zeros(words(vocab), dtype=torch.int32)
    grammar.fill(row)
    return ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab].bool()
