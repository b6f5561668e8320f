"""Table-driven cases for prompt lookup."""
import numpy as np
import pytest

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence
from specserve.spec_decode.lookup import NgramProposer

CASES = [
    # (name, tokens, k, min_n, max_n, expected)
    ("the latest match of the longest n wins", [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 1, 3, [8, 1]),
    ("a longer n beats a later shorter match", [5, 6, 7, 0, 9, 7, 4, 6, 7], 2, 1, 3, [0, 9]),
    ("falls back to shorter n", [4, 1, 9, 9, 2, 1], 3, 1, 3, [9, 9, 2]),
    ("nothing below min_n", [4, 1, 9, 9, 2, 1], 3, 2, 3, []),
    ("no repeat, no proposal", [1, 2, 3, 4, 5], 4, 1, 4, []),
    ("k caps the proposal", [1, 2, 3, 4, 5, 1, 2], 2, 2, 2, [3, 4]),
    ("a match near the end proposes what exists", [3, 1, 2, 1, 2], 4, 2, 2, [1, 2]),
    ("too short to look up", [7], 2, 1, 3, []),
]


@pytest.mark.parametrize("name,tokens,k,lo,hi,want", CASES, ids=[c[0] for c in CASES])
def test_lookup(name, tokens, k, lo, hi, want):
    assert NgramProposer(lo, hi).lookup(tokens, k) == want


def reference_lookup(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, by brute force over every window before the last token."""
    arr = np.asarray(tokens)
    for n in range(min(hi, len(arr) - 1), lo - 1, -1):
        hits = [s for s in range(len(arr) - n) if (arr[s:s + n] == arr[-n:]).all()]
        if hits:
            return arr[hits[-1] + n:hits[-1] + n + k].tolist()
    return []


@pytest.mark.parametrize("seed", range(5))
def test_the_index_grown_token_by_token_matches_the_definition(seed):
    """A request's index is brought up to date with the tokens committed since its last lookup (one or
    several a step): every lookup on the way equals the brute-force one."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 6, size=int(rng.integers(1, 40))).tolist()
    lo, hi = sorted(int(x) for x in rng.integers(1, 5, size=2))
    proposer = NgramProposer(lo, hi)
    s = Sequence("r", tokens, SamplingParams(max_tokens=300, temperature=0))
    for _ in range(120):
        k = int(rng.integers(1, 6))
        assert proposer.hit(s, k) == reference_lookup(s.token_ids, k, lo, hi)
        s.token_ids += rng.integers(0, 6, size=int(rng.integers(1, 4))).tolist()


def test_a_peeked_hit_is_what_the_proposer_drafts_and_is_looked_up_once_per_length():
    """The scheduler peeks at the ceiling before planning; drafting at the planned length reuses that
    hit (a prefix of it) until the sequence grows."""
    proposer = NgramProposer(2, 2)
    calls = []
    lookup = proposer.lookup
    proposer.lookup = lambda tokens, k, index: calls.append(k) or lookup(tokens, k, index)
    s = Sequence("r", [1, 2, 3, 4, 5, 1, 2], SamplingParams(max_tokens=8, temperature=0))
    assert proposer.peek(s, 4) == ("ngram", 4, 0)  # a hit of 4, no draft forward
    assert proposer.hit(s, 2) == [3, 4] and calls == [4]
    s.token_ids.append(3)
    assert proposer.hit(s, 2) == [4, 5] and calls == [4, 2]
    s.token_ids += [9, 9]
    assert proposer.peek(s, 4) == ("ngram", 0, 0)
