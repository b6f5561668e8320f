"""The sampler's side (specserve/structured_output/masks.py): each verify row's bias is the grammar's state
after the drafts before it, and the grammar is back at the committed output's state afterwards."""
from types import SimpleNamespace

import torch

from specserve import LLM
from specserve.structured_output.masks import logit_bias
from specserve.structured_output.params import StructuredOutputsParams as Guide
from tests.structured_output.guide_fixtures import allowed


def test_a_drafted_end_of_sequence_leaves_the_grammar_usable(tiny_target):
    """A draft may end the output (EOS) where the grammar is complete; the matcher must not consume it (a
    complete matcher given EOS enters an error state that no rollback leaves), or every later mask of the
    request would allow only EOS and its output would stop half-written."""
    llm = LLM(model=str(tiny_target), dtype="float32")
    grammar = llm.engine.inputs.grammars.matcher(Guide(choice=("ab",)))
    vocab, eos = 260, 259
    start = allowed(grammar, vocab)
    request = SimpleNamespace(seq=SimpleNamespace(grammar=grammar))
    rows, bias = logit_bias([request], {0: [ord("a"), ord("b"), eos]}, [4], vocab, "cpu")
    assert rows.tolist() == [0, 1, 2, 3, 4]
    assert bias[3, eos] == 0 and (bias[3] == 0).sum() == 1  # after "ab": only EOS
    assert not grammar.matcher.is_error() and torch.equal(allowed(grammar, vocab), start)  # rolled back
    assert grammar.advance([ord("a"), ord("b"), eos, ord("a")]) == 2 and not grammar.matcher.is_error()
