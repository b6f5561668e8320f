"""Table-driven cases for prompt lookup."""
import pytest

from specserve.spec.proposer import NgramProposer

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
