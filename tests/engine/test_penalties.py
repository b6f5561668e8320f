"""vLLM's penalties (specserve/sampling_ops.py `penalize`), table-driven, and in the engine: greedy output under
penalties is the same with every speculation method as without speculation, since each verify row is
penalised as plain decoding penalises that position (the drafts before it count as output); a draft model's
proposals are penalised alike, so a draft that is the target itself has every draft accepted under penalties."""
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.sampling_ops import penalize, penalize_draft
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


@pytest.mark.parametrize("vocab_map", [None, [5, 0, 2, 3]], ids=["full head", "reduced head"])
@pytest.mark.parametrize("name,params,prompt,output,drafts,row,expected", CASES, ids=[c[0] for c in CASES])
def test_a_draft_row_is_penalised_as_its_verify_row(name, params, prompt, output, drafts, row, expected, vocab_map):
    drafts = torch.tensor((drafts or [])[:row], dtype=torch.long)
    vmap = None if vocab_map is None else torch.tensor(vocab_map)
    rows = LOGITS if vmap is None else LOGITS[:, vmap]
    got = penalize_draft(rows.clone(), SamplingParams(**params), prompt, output, drafts, V, vmap)
    want = torch.tensor([expected]) if vmap is None else torch.tensor([expected])[:, vmap]
    assert got[0].tolist() == pytest.approx(want[0].tolist())


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
    # drafts were verified under the penalties (prompt lookup proposes repeats, which they reject: few pass;
    # suffix decoding drafts only as far as its match is long and unanimous: fewer)
    assert sum(o.spec["num_draft_tokens"] for o in outs) > (5 if method == "suffix" else 20)


def test_penalties_are_checked():
    from specserve.errors import InvalidRequestError
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**bad)


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_draft_that_is_the_target_has_every_draft_accepted_under_penalties(tiny_target, temperature):
    """Unpenalised proposals from the target's own weights were accepted about half the time here (the
    penalties move the target's choice away from repeats the draft kept proposing)."""
    llm = LLM(model=str(tiny_target), dtype="float32",
              speculative_config={"method": "draft_model", "model": str(tiny_target), "num_speculative_tokens": 4})
    outs = llm.generate(prompts(24, seed=9), SamplingParams(max_tokens=20, temperature=temperature, ignore_eos=True,
                                                            seed=3, **PENALTIES))
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    assert drafted > 100 and sum(o.spec["num_accepted_tokens"] for o in outs) >= 0.95 * drafted
