"""vLLM's penalties (specserve/sampling.py `penalize`), table-driven, and in the engine: greedy output under
penalties is the same with every speculation method as without speculation, since each verify row is
penalised as plain decoding penalises that position (the drafts before it count as output)."""
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.sampling import penalize
from tests.spec_decode.test_speculative_engine import METHODS, prompts, spec_config

V = 6
LOGITS = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 0.0]])

CASES = [
    # (name, params, prompt, output, drafts, row, expected row)
    ("no penalty leaves the logits", {}, [0], [1], None, 0, [2.0, -1.0, 0.5, 1.0, -2.0, 0.0]),
    ("presence: once per output token", {"presence_penalty": 0.5}, [0], [1, 1, 3], None, 0,
     [2.0, -1.5, 0.5, 0.5, -2.0, 0.0]),
    ("frequency: per occurrence", {"frequency_penalty": 0.5}, [0], [1, 1, 3], None, 0,
     [2.0, -2.0, 0.5, 0.5, -2.0, 0.0]),
    ("repetition: prompt and output, divides positive, multiplies negative", {"repetition_penalty": 2.0},
     [0], [4], None, 0, [1.0, -1.0, 0.5, 1.0, -4.0, 0.0]),
    ("row 0 of a verify: the drafts are not output yet", {"frequency_penalty": 1.0}, [5], [], [2, 3], 0,
     [2.0, -1.0, 0.5, 1.0, -2.0, 0.0]),
    ("row 2 of a verify: both drafts before it count", {"frequency_penalty": 1.0}, [5], [2], [2, 3], 2,
     [2.0, -1.0, -1.5, 0.0, -2.0, 0.0]),
]


@pytest.mark.parametrize("name,params,prompt,output,drafts,row,expected", CASES, ids=[c[0] for c in CASES])
def test_penalize(name, params, prompt, output, drafts, row, expected):
    n = 1 + (len(drafts) if drafts else 0)
    logits = LOGITS.expand(n, V).clone()
    got = penalize(logits, SamplingParams(**params), prompt, output,
                   None if drafts is None else torch.tensor(drafts))
    assert got[row].tolist() == pytest.approx(expected)
    assert torch.equal(logits, LOGITS.expand(n, V))  # the input is not changed


PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def penalized_baseline(tiny_target):
    ps = prompts(24, seed=9)
    llm = LLM(model=str(tiny_target), dtype="float32")
    plain = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    want = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                                 **PENALTIES))]
    assert sum(a != b for a, b in zip(plain, want)) > 6  # the penalties change the output
    return ps, want


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_under_penalties_is_token_identical(tiny_target, request, penalized_baseline, method):
    ps, want = penalized_baseline
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec_config(method, request, 4))
    outs = llm.generate(ps, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, **PENALTIES))
    assert [o.token_ids for o in outs] == want
    # drafts were verified under the penalties (prompt lookup proposes repeats, which they reject: few pass)
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 20


def test_penalties_are_checked():
    from specserve.errors import InvalidRequestError
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)
