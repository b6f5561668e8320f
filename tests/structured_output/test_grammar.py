"""Compiling a request's guide (specserve/structured_output/grammar.py): what cannot compile is a clear error
that leaves the engine as it was, and the output matches its schema, regex, choice or grammar."""
import json
import re

import pytest

from specserve import LLM, SamplingParams
from specserve.errors import InvalidRequestError
from specserve.structured_output.params import StructuredOutputsParams as Guide
from tests.structured_output.guide_fixtures import GUIDES


def test_greedy_output_matches_its_guide(guided_baseline):
    _, outs = guided_baseline
    finished = 0
    for i, out in enumerate(outs):
        guide, text = GUIDES[i % len(GUIDES)], out.text
        if out.finish_reason != "stop":  # cut by max_tokens: a prefix of a match
            continue
        finished += 1
        if guide.json is not None:
            value = json.loads(text)
            assert set(value) == {"a", "b"} and isinstance(value["b"], int) and len(value["a"]) <= 6
        elif guide.json_object:
            assert isinstance(json.loads(text), dict)
        elif guide.regex is not None:
            assert re.fullmatch(guide.regex, text), text
        elif guide.choice is not None:
            assert text in guide.choice
        else:
            assert re.fullmatch(r"x[0-9]{1,3}(,[0-9]{1,3})*", text), text
    assert finished >= 10  # most guides end well within 40 tokens, even for a random model


@pytest.mark.parametrize("fields", [{"regex": "[a-"}, {"json": "{\"type\": 5}"}, {"grammar": "start: undefined_rule"}])
def test_guides_that_cannot_compile_are_clear_errors(tiny_target, fields):
    llm = LLM(model=str(tiny_target), dtype="float32")
    with pytest.raises(InvalidRequestError, match="invalid structured output"):
        llm.engine.add_request([1, 2, 3], SamplingParams(structured_outputs=Guide(**fields)))
    assert not llm.engine.has_unfinished()
