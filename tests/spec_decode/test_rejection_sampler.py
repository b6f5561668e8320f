"""Table-driven cases for the rejection sampler, plus its statistical convergence to the target."""
import pytest
import torch

from specserve.spec_decode import rejection_sampler

V = 6


def rejection_sample(argmax, p, drafts, q, num_draft, generators):
    """The cases below are written per request, padded to K: flatten them into the sampler's layout
    ([T] / [T, V] verify rows, [D] / [D, V] draft rows) and read back each request's committed tokens."""
    verify = [(i, j) for i, l in enumerate(num_draft) for j in range(l + 1)]
    drafted = [(i, j) for i, l in enumerate(num_draft) for j in range(l)]
    rows = lambda t, idx: t[[i for i, _ in idx], [j for _, j in idx]]  # noqa: E731
    out = rejection_sampler.rejection_sample(
        rows(argmax, verify), None if p is None else rows(p, verify), rows(drafts, drafted),
        None if q is None else rows(q, drafted), num_draft,
        None if generators[0] is None else generators)
    return [[t for t in r if t != rejection_sampler.PLACEHOLDER] for r in out.tolist()]


def onehot_probs(rows):
    """rows: list of token ids -> [len, V] one-hot distributions."""
    return torch.nn.functional.one_hot(torch.tensor(rows), V).float()


GREEDY_CASES = [
    # (target argmax per position (K+1), drafts, expected committed)
    ("all accepted -> bonus", [1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),
    ("first rejected -> recovered", [5, 2, 3, 4], [1, 2, 3], [5]),
    ("middle rejected", [1, 2, 0, 4], [1, 2, 3], [1, 2, 0]),
    ("no drafts = plain decoding", [3], [], [3]),
]


@pytest.mark.parametrize("name,argmax,drafts,want", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_table(name, argmax, drafts, want):
    k = 3
    a = torch.tensor([argmax + [0] * (k + 1 - len(argmax))])
    d = torch.tensor([drafts + [0] * (k - len(drafts))])
    assert rejection_sample(a, None, d, None, [len(drafts)], [None]) == [want]


def test_ragged_batch_with_zero_length_rows():
    a = torch.tensor([[1, 2, 3], [4, 0, 0], [5, 5, 0]])
    d = torch.tensor([[1, 2], [9, 9], [5, 1]])
    assert rejection_sample(a, None, d, None, [2, 0, 2], [None] * 3) == [[1, 2, 3], [4], [5, 5]]


def test_sampled_certain_cases():
    """p one-hot: the outcome is forced whatever the random draws."""
    gen = torch.Generator().manual_seed(0)
    p = onehot_probs([1, 2, 3, 4])[None]  # target wants 1, 2, 3 then bonus 4
    q = torch.full((1, 3, V), 1.0 / V)
    accepted = rejection_sample(p.argmax(-1), p, torch.tensor([[1, 2, 3]]), q, [3], [gen])
    assert accepted == [[1, 2, 3, 4]]
    rejected = rejection_sample(p.argmax(-1), p, torch.tensor([[1, 0, 3]]), q, [3], [gen])
    assert rejected == [[1, 2]]  # p(0) = 0 at position 2: rejected, recovered from max(0, p - q) -> 2
    ngram = rejection_sample(p.argmax(-1), p, torch.tensor([[1, 5, 3]]), None, [3], [gen])
    assert ngram == [[1, 2]]  # deterministic proposal (q one-hot)


def test_no_random_draws_for_requests_without_drafts():
    p = torch.softmax(torch.randn(1, 1, V), -1)
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    rejection_sample(p.argmax(-1), p, torch.zeros(1, 0, dtype=torch.long), None, [0], [g1])
    from specserve.sampling_ops import uniforms
    uniforms([g2], 1, "cpu", torch.float64)  # plain decoding's single draw: one uniform (inverse CDF)
    assert torch.equal(g1.get_state(), g2.get_state())


def tv(a, b):
    return 0.5 * (a - b).abs().sum().item()


@pytest.mark.parametrize("k,proposer", [(1, "draft"), (3, "draft"), (3, "deterministic")])
def test_convergence_to_target_distribution(k, proposer):
    """Design after vLLM's test: the empirical distribution of the first committed token approaches p
    as samples grow, and is closer to p than random reference distributions are. "deterministic" is an
    n-gram-like proposer: always the same tokens, q one-hot."""
    torch.manual_seed(0)
    p_rows = torch.softmax(torch.randn(k + 1, V) * 2, -1)
    q_rows = torch.softmax(torch.randn(k, V) * 2, -1)  # a draft that disagrees a lot
    gen = torch.Generator().manual_seed(1)
    counts, distances = torch.zeros(V), {}
    n_done = 0
    for n in (100, 1000, 10000):
        while n_done < n:
            if proposer == "draft":
                drafts = torch.multinomial(q_rows, 1, generator=gen).T  # [1, k] sampled from q
                q = q_rows[None]
            else:
                drafts, q = q_rows.argmax(-1)[None], None
            out = rejection_sample(p_rows.argmax(-1)[None], p_rows[None], drafts, q, [k], [gen])
            counts[out[0][0]] += 1
            n_done += 1
        distances[n] = tv(counts / n, p_rows[0])
    assert distances[10000] < distances[100]
    assert distances[10000] < 0.03
    references = [tv(torch.distributions.Dirichlet(torch.ones(V)).sample(), p_rows[0]) for _ in range(50)]
    assert distances[10000] < min(references)
