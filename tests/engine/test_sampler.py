"""The sampler's host-side greedy path (every request greedy, no logprobs) against the vectorized rejection
sampler it stands in for: asking for logprobs sends the same rows through rejection_sample."""
from types import SimpleNamespace

import pytest
import torch

from specserve.step_types import Proposal
from specserve.engine.sampler import Sampler
from specserve.engine.sampling_params import SamplingParams


def _requests(n: int, logprobs: bool):
    params = SamplingParams(temperature=0.0, logprobs=1 if logprobs else None)
    return [SimpleNamespace(seq=SimpleNamespace(params=params, generator=None)) for _ in range(n)]


@pytest.mark.parametrize("lengths, prefills", [
    ([0], 0),              # plain decoding
    ([0, 0, 0], 2),        # a decode batch and two prefills completing their prompts
    ([3], 0),              # one verify
    ([2, 0, 4, 1], 1),     # mixed draft lengths, then a prefill
])
def test_greedy_path_commits_what_rejection_sampling_commits(lengths, prefills):
    gen = torch.Generator().manual_seed(sum(lengths) + prefills)
    vocab, k = 11, max(lengths)
    rows = sum(length + 1 for length in lengths) + prefills
    for _ in range(20):
        logits = torch.randn(rows, vocab, generator=gen)
        # Drafts that often match the target's argmax, so that acceptance runs vary in length.
        argmax, drafts, row = logits.argmax(-1), torch.zeros(len(lengths), k, dtype=torch.long), 0
        for i, length in enumerate(lengths):
            for j in range(length):
                hit = torch.rand((), generator=gen) < 0.7
                drafts[i, j] = argmax[row + j] if hit else torch.randint(vocab, (), generator=gen)
            row += length + 1
        proposal = Proposal(list(lengths), drafts)
        n = len(lengths) + prefills
        fast, lps_fast, _, _ = Sampler()(logits, _requests(n, logprobs=False), proposal)
        reference, lps, _, _ = Sampler()(logits, _requests(n, logprobs=True), proposal)
        assert fast == reference
        assert lps_fast == [None] * n and all(len(lp) == len(t) for lp, t in zip(lps, reference))


def test_draw_follows_the_weights_and_never_draws_a_zero_weight():
    """sampling.draw (inverse CDF, one uniform a row): each row's frequencies match its normalised weights
    (unnormalised rows, zeros inside and at the end), and a zero weight is never drawn."""
    from specserve.sampling_ops import draw
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 1.0, 0.0],    # sums to 4, zeros between and after
                            [5.0, 0.0, 0.0, 0.0, 0.0, 0.0],    # one token
                            [1e-3, 1e-3, 0.0, 0.0, 0.0, 2e-3]])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    n = 20000
    counts = torch.zeros(3, 6)
    for _ in range(n):
        counts[torch.arange(3), draw(weights, gens)] += 1
    want = weights / weights.sum(-1, keepdim=True)
    assert counts[want == 0].sum() == 0
    # binomial standard error at n = 20,000 is at most 0.0035: 5 of them
    assert (counts / n - want).abs().max() < 0.018


def test_draw_is_reproducible_per_generator():
    from specserve.sampling_ops import draw
    probs = torch.softmax(torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)), -1)
    first = draw(probs, [torch.Generator().manual_seed(s) for s in (1, 2, 3, 4)])
    # row 2 alone, with the same seed: the same token (a row's draw never depends on the other rows)
    assert draw(probs[2:3], [torch.Generator().manual_seed(3)]).item() == first[2].item()


def _seeded(n: int, seed: int, output_tokens: int, temperature: float = 1.0):
    params = SamplingParams(temperature=temperature, seed=seed)
    seq = SimpleNamespace(params=params, generator=None, num_output_tokens=output_tokens)
    return [SimpleNamespace(seq=seq) for _ in range(n)]


@pytest.mark.parametrize("length", [0, 1, 3, 6])
def test_a_seeded_verify_commits_the_tokens_plain_decoding_draws_at_each_position(length):
    """A seeded request verifying `length` drafts commits, at every position it reaches, the token a plain
    decode step (no drafts) draws at that output position; drafts are accepted while they equal it."""
    gen = torch.Generator().manual_seed(length)
    vocab, start = 13, 5  # the request has 5 output tokens before this step
    for trial in range(30):
        logits = torch.randn(length + 1, vocab, generator=gen)
        plain = [Sampler()(logits[j:j + 1], _seeded(1, 77, start + j), Proposal([0], torch.zeros(1, 0).long()))[0][0][0]
                 for j in range(length + 1)]
        # drafts: the plain draws with a wrong token somewhere (or none), so runs end at varying positions
        drafts = torch.tensor([plain[:length]], dtype=torch.long).view(1, length)
        wrong = int(torch.randint(length + 1, (), generator=gen))
        if wrong < length:
            drafts[0, wrong] = (plain[wrong] + 1) % vocab
        tokens = Sampler()(logits, _seeded(1, 77, start), Proposal([length], drafts))[0][0]
        n = min(wrong, length)
        assert tokens == plain[:n + 1], (trial, wrong)
