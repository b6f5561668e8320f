"""Speculative decoding with every model family as the target stays greedy token-identical: prompt lookup, a
standalone draft of another family sharing the vocabulary (the tiny Llama draft: all the tiny checkpoints
share the byte-level tokenizer), and the family's own checkpoint as its draft (every draft token accepted)."""
import pytest

from specserve import LLM
from tests.model.family_fixtures import FAMILIES, make_family_dir
from tests.spec_decode.test_speculative_engine import GREEDY, prompts


@pytest.fixture(scope="module", params=list(FAMILIES))
def target(request, tmp_path_factory):
    path = make_family_dir(tmp_path_factory.mktemp(request.param) / "hf", request.param)
    ps = prompts(16, seed=4)
    return path, ps, [o.token_ids for o in LLM(model=str(path), dtype="float32").generate(ps, GREEDY)]


@pytest.mark.parametrize("method", ["ngram", "llama-draft", "own-draft"])
def test_greedy_speculation_is_token_identical(target, method, request):
    path, ps, want = target
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    else:
        draft = request.getfixturevalue("tiny_draft") if method == "llama-draft" else path
        spec = {"model": str(draft), "num_speculative_tokens": 3}
    outs = LLM(model=str(path), dtype="float32", max_num_seqs=4, speculative_config=spec).generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    drafted, accepted = (sum(o.spec[k] for o in outs) for k in ("num_draft_tokens", "num_accepted_tokens"))
    assert drafted > 0
    if method == "own-draft":
        assert accepted == drafted
