"""A seeded request gives the same tokens whatever the load, policy, proposer or draft length: its draws are
keyed by output position (sampling.draw_at), and drafts are accepted while they equal the token plain
decoding draws there. The distribution stays the target's (test_speculative_engine's convergence tests)."""
import random

import pytest

from specserve import LLM, SamplingParams
from tests.spec_decode.policy_fixtures import BUILT_IN, cheap_drafts
from tests.spec_decode.test_speculative_engine import spec_config

SEEDED = [SamplingParams(max_tokens=24, temperature=1.0, seed=1234, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=-5, ignore_eos=True)]
PROMPTS = [[7, 8, 9, 7, 8, 9, 7, 8], [3, 40, 41, 3, 40, 41, 3]]  # repeats: prompt lookup proposes too


def companions(rng: random.Random, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n other requests of random lengths, greedy, sampled, seeded or not: the load around the seeded ones."""
    prompts, params = [], []
    for _ in range(n):
        prompts.append([rng.randrange(256) for _ in range(rng.randint(3, 40))])
        temperature = rng.choice([0.0, 0.8, 1.0])
        seed = rng.choice([None, rng.randrange(1000)])
        params.append(SamplingParams(max_tokens=rng.randint(4, 30), temperature=temperature, seed=seed,
                                     ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_target):
    llm = LLM(model=str(tiny_target), dtype="float32")
    return [o.token_ids for o in llm.generate(PROMPTS, SEEDED)]


def run_under_load(llm, rng, others: int) -> list:
    """The seeded requests among `others` companions, in a random order; their outputs."""
    prompts, params = companions(rng, others)
    order = list(range(len(prompts) + len(PROMPTS)))
    rng.shuffle(order)
    everything = [(p, sp) for p, sp in zip(prompts + PROMPTS, params + SEEDED)]
    outs = llm.generate([everything[i][0] for i in order], [everything[i][1] for i in order])
    where = {i: r for r, i in enumerate(order)}
    return [outs[where[len(prompts) + j]] for j in range(len(PROMPTS))]


@pytest.mark.parametrize("policy, options", BUILT_IN, ids=[p for p, _ in BUILT_IN])
def test_seeded_output_is_the_same_under_every_policy_and_load(tiny_target, tiny_draft, reference, policy, options):
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 4, "ngram_first": True, "policy": policy,
            "policy_options": options}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=8)
    if llm.engine.models.has_cost:
        llm.engine.models._cost = cheap_drafts(llm)  # drafting pays: the policies draft, at lengths that vary
    rng = random.Random(policy)
    drafted = 0
    for repeat in range(10):
        outs = run_under_load(llm, rng, others=[0, 1, 3, 7, 12][repeat % 5])
        assert [o.token_ids for o in outs] == reference, f"repeat {repeat}"
        drafted += sum(o.spec["num_draft_tokens"] for o in outs)
    assert (drafted > 0) == (policy != "off")  # the seeded requests themselves drafted


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle", "eagle+ngram+suffix"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_seeded_output_is_the_same_for_every_proposer_and_draft_length(tiny_target, request, reference, method, k):
    spec = spec_config(method, request, k)
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=8)
    outs = llm.generate(PROMPTS, SEEDED)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 0  # drafts were accepted, not only rejected
    assert [o.token_ids for o in run_under_load(llm, random.Random(k), others=5)] == reference
