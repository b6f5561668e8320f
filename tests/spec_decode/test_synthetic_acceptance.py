"""Synthetic acceptance (benchmarks only): the config refuses it unless named, drafts are kept at the set
rates (statistically), the committed token after them is the target's, and responses say it is synthetic."""
import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import SpecServeError
from specserve.spec_decode import rejection_sampler
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.synthetic import SyntheticAcceptance, rates_for_length

BAD_CONFIGS = [
    # (what is wrong, config beyond {"method": "ngram", "num_speculative_tokens": 3}, words of the error)
    ("rates without the method", {"synthetic_acceptance_rates": [0.9, 0.8, 0.7]}, "needs"),
    ("the method without rates", {"rejection_sample_method": "synthetic"}, "exactly one"),
    ("rates and a length", {"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [1, 1, 1],
                            "synthetic_acceptance_length": 2.0}, "exactly one"),
    ("rates of the wrong length", {"rejection_sample_method": "synthetic",
                                   "synthetic_acceptance_rates": [0.9, 0.8]}, "3 numbers"),
    ("increasing rates", {"rejection_sample_method": "synthetic",
                          "synthetic_acceptance_rates": [0.5, 0.8, 0.2]}, "must not increase"),
    ("a rate above 1", {"rejection_sample_method": "synthetic",
                        "synthetic_acceptance_rates": [1.5, 0.8, 0.2]}, "in [0, 1]"),
    ("a length past k + 1", {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.5}, "[1,"),
    ("an unknown method", {"rejection_sample_method": "typical"}, "standard"),
]


@pytest.mark.parametrize("name,extra,words", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_config_refuses(name, extra, words):
    with pytest.raises(SpecServeError, match=None) as e:
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, **extra})
    assert words in str(e.value)


def test_config_rates():
    base = {"method": "ngram", "num_speculative_tokens": 3}
    assert SpeculativeConfig.parse(base).synthetic_rates is None
    rates = [0.9, 0.6, 0.3]
    got = SpeculativeConfig.parse({**base, "rejection_sample_method": "synthetic", "synthetic_acceptance_rates": rates})
    assert got.synthetic_rates == rates
    by_length = SpeculativeConfig.parse({**base, "rejection_sample_method": "synthetic",
                                         "synthetic_acceptance_length": 2.5}).synthetic_rates
    assert 1 + sum(by_length) == pytest.approx(2.5)


@pytest.mark.parametrize("length,k", [(1.0, 4), (2.0, 1), (2.5, 4), (3.24, 4), (5.0, 4), (1.7, 7)])
def test_rates_for_length(length, k):
    rates = rates_for_length(length, k)
    assert len(rates) == k and 1 + sum(rates) == pytest.approx(length, abs=1e-9)
    assert all(b <= a for a, b in zip(rates, rates[1:]))


def test_counts_follow_the_rates():
    """Position j is reached with probability rates[j] (binomial, 5 sigma), never past a request's length,
    and a seed repeats its draws."""
    rates, n = [0.9, 0.6, 0.3, 0.0], 20000
    counts = np.array(SyntheticAcceptance(rates, seed=3).counts([4] * n))
    for j, r in enumerate(rates):
        sigma = max((r * (1 - r) / n) ** 0.5, 1e-9)
        assert abs((counts > j).mean() - r) <= 5 * sigma + 1e-12
    lengths = [0, 1, 2, 3, 4] * 200
    short = SyntheticAcceptance(rates, seed=3).counts(lengths)
    assert all(c <= length for c, length in zip(short, lengths))
    assert short == SyntheticAcceptance(rates, seed=3).counts(lengths)


TABLE = [
    # (target argmax per position (K+1 = 4), drafts, synthetic count, committed): drafts kept whatever the
    # target says, then the target's own token at the row after them
    ("all kept -> bonus", [1, 2, 3, 4], [5, 5, 5], 3, [5, 5, 5, 4]),
    ("none kept -> the target's first", [1, 2, 3, 4], [1, 2, 3], 0, [1]),
    ("two kept", [0, 0, 3, 4], [1, 2, 3], 2, [1, 2, 3]),
]


@pytest.mark.parametrize("name,argmax,drafts,count,want", TABLE, ids=[c[0] for c in TABLE])
@pytest.mark.parametrize("sampled", [False, True])
def test_rejection_sample_with_counts(name, argmax, drafts, count, want, sampled):
    """Greedy and sampled alike: with a one-hot p at each row the sampled request draws the same tokens."""
    v = 6
    p = torch.nn.functional.one_hot(torch.tensor(argmax), v).double() if sampled else None
    gens = [torch.Generator().manual_seed(0)] if sampled else None
    out = rejection_sampler.rejection_sample(torch.tensor(argmax), p, torch.tensor(drafts), None, [3], gens,
                                             synthetic_counts=[count])
    assert [t for t in out[0].tolist() if t != rejection_sampler.PLACEHOLDER] == want


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_keeps_drafts_at_the_rates(tiny_target, tiny_draft, temperature):
    """A draft model's every token runs and is verified at full cost; the share reaching each position follows
    the rates (the static policy drafts k every step), and every response says it was synthetic."""
    rates = [0.9, 0.5, 0.2]
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": rates}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec)
    params = SamplingParams(max_tokens=120, temperature=temperature, ignore_eos=True, seed=None)
    outs = llm.generate([[i + 1, 7, i + 3] for i in range(12)], params)
    verifications = sum(o.spec["num_drafts"] for o in outs)
    reached = [sum(o.spec["accepted_per_position"][j] for o in outs) for j in range(3)]
    assert all(o.spec["synthetic_acceptance_rates"] == rates for o in outs)
    assert verifications > 300
    for j, r in enumerate(rates):  # drafts cut short near max_tokens lower the shares a little
        assert r - 0.1 <= reached[j] / verifications <= r + 0.05
