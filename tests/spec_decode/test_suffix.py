"""Suffix decoding (spec_decode/suffix.py): the longest match, continued by the most frequent followers."""
from types import SimpleNamespace

import numpy as np
import pytest

from specserve.spec_decode.suffix import (SEPARATOR, OutputCache, SuffixOptions, SuffixProposer, continue_match,
                                          longest_match)


def arr(tokens):
    return np.array(tokens, dtype=np.int32)


@pytest.mark.parametrize("haystack, context, depth, want_m, want_ends", [
    ([1, 2, 3, 9, 1, 2, 3], [1, 2, 3], 64, 3, [3]),            # the earlier 1 2 3, followed by 9
    ([5, 2, 3, 9, 1, 2, 3, 7, 2, 3], [1, 2, 3], 64, 3, [7]),    # 2 3 twice; 1 2 3 once
    ([5, 2, 3, 9, 1, 2, 3, 7, 2, 3], [1, 2, 3], 2, 2, [3, 7]),  # capped at 2 tokens: both
    ([4, 4, 4], [8, 4], 64, 1, [1, 2]),                          # only the last token matches
    ([1, 2, 3], [7], 64, 0, []),                                 # nothing
    ([3, 1, 2], [1, 2], 64, 0, []),                              # 1 2 occurs, but nothing follows it
])
def test_longest_match(haystack, context, depth, want_m, want_ends):
    m, ends = longest_match(arr(haystack), arr(context), depth)
    assert m == want_m and list(ends) == want_ends


def test_continuation_takes_the_majority_and_stops_below_min_prob():
    hay = arr([1, 5, 6, 1, 5, 6, 1, 5, 7, 1, 8, SEPARATOR])
    ends = np.array([1, 4, 7, 10])  # after each "1"
    tokens, conf = continue_match([(hay, ends)], limit=8, min_prob=0.1)
    assert tokens[:2] == [5, 6] and conf[:2] == pytest.approx([0.75, 0.5])
    tokens, conf = continue_match([(hay, ends)], limit=8, min_prob=0.6)
    assert tokens == [5]  # 5 follows 3 of 4; then 6 follows 2 of those 3: 0.75 * 2/3 < 0.6
    # two sources count together
    other = arr([1, 8, SEPARATOR, 1, 8, SEPARATOR, 1, 8, SEPARATOR])
    tokens, _ = continue_match([(hay, ends), (other, np.array([1, 4, 7]))], limit=1, min_prob=0.0)
    assert tokens == [8]  # 5 follows 3 occurrences, 8 follows 1 + 3
    tokens, _ = continue_match([(hay, np.array([10])), (other, np.array([1, 4, 7]))], limit=1, min_prob=0.0)
    assert tokens == [8]


def seq(request_id, tokens, prompt_len):
    return SimpleNamespace(request_id=request_id, token_ids=list(tokens), num_prompt_tokens=prompt_len)


def test_a_long_match_drafts_long_and_a_short_one_little():
    p = SuffixProposer(SuffixOptions(spec_factor=1.0, min_token_prob=0.1, max_cached_requests=0))
    code = list(range(100, 140))  # a "file" of 40 distinct tokens
    s = seq("a", code + [1] + code[:12], 41)  # re-emitting the file: 12 tokens match
    assert p.hit(s, 10) == code[12:22]
    assert p.confidences(s, 10) == [1.0] * 10
    short = seq("b", code + [1] + code[:1], 41)  # one token matched: drafts one
    assert p.hit(short, 10) == code[1:2]


def test_finished_outputs_serve_later_requests_and_the_cache_is_bounded():
    p = SuffixProposer(SuffixOptions(max_cached_requests=2, min_token_prob=0.1))
    answer = [7, 8, 9, 10, 11, 12, 13]
    first = seq("a", [1, 2, 3] + answer, 3)
    p.hit(first, 4)
    p.free("a")  # its output joins the cache
    later = seq("b", [4, 5, 7, 8, 9], 2)  # its own context has no earlier 7 8 9
    assert p.hit(later, 4) == [10, 11, 12]  # factor 1.0: 3 tokens matched, 3 drafted
    for i in range(3):  # two newer outputs evict the first
        other = seq(f"o{i}", [1, 2] + [50 + i, 60 + i], 2)
        p.hit(other, 1)
        p.free(f"o{i}")
    assert len(p.cache.documents) == 2
    assert p.hit(seq("c", [4, 5, 7, 8, 9], 2), 4) == []


def test_the_cache_keeps_at_most_max_tokens():
    cache = OutputCache(max_requests=100, max_tokens=10)
    for i in range(5):
        cache.add(arr([i] * 4))
    assert sum(map(len, cache.documents)) <= 10 and cache.documents[-1][0] == 4


def test_reset_prefix_cache_forgets_earlier_outputs_too(tiny_target):
    """A benchmark that replays a prompt must not draft its reply from the reply of the run before."""
    from specserve import LLM, SamplingParams
    llm = LLM(model=str(tiny_target), dtype="float32",
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert llm.engine.proposer.cache.documents
    llm.reset_prefix_cache()
    assert not llm.engine.proposer.cache.documents


def naive_longest_match(haystack, context, depth):
    best, ends = 0, []
    for end in range(1, len(haystack)):  # an occurrence ending before `end`, with haystack[end] after it
        m = 0
        while m < min(depth, len(context)) and end - 1 - m >= 0 and haystack[end - 1 - m] == context[-1 - m]:
            m += 1
        if m and m > best:
            best, ends = m, [end]
        elif m and m == best:
            ends.append(end)
    return best, ends


@pytest.mark.parametrize("alphabet, size", [(2, 300), (3, 120), (30, 400), (2, 40)])
def test_longest_match_agrees_with_brute_force(alphabet, size):
    rng = np.random.default_rng(alphabet * size)
    for trial in range(40):  # few and many candidates, both narrowing paths
        hay = rng.integers(0, alphabet, size).astype(np.int32)
        context = np.concatenate([hay[:rng.integers(1, size)], rng.integers(0, alphabet, 3)]).astype(np.int32)
        depth = int(rng.choice([3, 8, 64]))
        m, ends = longest_match(hay, context, depth)
        assert (m, list(ends)) == naive_longest_match(hay.tolist(), context.tolist(), depth), trial


def test_a_match_carried_forward_drafts_what_a_fresh_search_drafts():
    """While the context keeps following its match, the carried occurrences give the fresh search's draft."""
    rng = np.random.default_rng(5)
    code = rng.integers(100, 160, 80).tolist()  # a "file" with repeats inside (60 distinct tokens)
    carried = SuffixProposer(SuffixOptions(max_cached_requests=0))
    for n in range(5, 60, 3):  # the reply re-emits the file, a few tokens a step
        s = seq("a", code + [1] + code[:n], 81)
        fresh = SuffixProposer(SuffixOptions(max_cached_requests=0))
        assert carried.hit(s, 8) == fresh.hit(s, 8), n
        assert carried.confidences(s, 8) == fresh.confidences(s, 8)
