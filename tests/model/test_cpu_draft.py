"""The draft chain in one native call (model/cpu_draft.py) drafts exactly what the step-by-step loop drafts."""
import pytest

from specserve import LLM, SamplingParams
from tests.spec_decode.test_speculative_engine import prompts


def run(tiny_target, draft, method: str, chain: bool, ps):
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=8)
    runner = llm.engine.proposer.runner
    calls = []
    if chain:
        original = runner.draft_chain
        runner.draft_chain = lambda *args: calls.append(1) or original(*args)
    else:
        runner.draft_chain = lambda *args: None  # the loop drafts
    outs = llm.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    return outs, len(calls)


@pytest.mark.parametrize("method, draft", [("eagle", "tiny_eagle"), ("draft_model", "tiny_draft")])
def test_the_chain_drafts_what_the_loop_drafts(tiny_target, request, method, draft):
    draft = request.getfixturevalue(draft)
    # long prompts too: a first draft step catches up over more rows than one attention piece (32)
    ps = prompts(12, seed=3) + [list(range(40, 120)), list(range(7, 60))]
    looped, _ = run(tiny_target, draft, method, False, ps)
    chained, calls = run(tiny_target, draft, method, True, ps)
    assert calls > 0
    assert [o.token_ids for o in chained] == [o.token_ids for o in looped]
    # the same drafts: the same ones accepted, request by request and position by position
    assert [o.spec for o in chained] == [o.spec for o in looped]
    assert sum(o.spec["num_accepted_tokens"] for o in chained) > 20
