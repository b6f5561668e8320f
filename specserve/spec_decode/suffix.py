"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024, arXiv 2411.04975; Arctic Inference; vLLM's `suffix`):
draft the tokens that most often followed the longest earlier occurrence of the context's end.

Where prompt lookup takes the latest occurrence of the last 2-4 tokens, this matches as far back as it can
(up to `max_depth` tokens), in the request's own prompt and output and in the outputs of earlier requests
(a bounded cache, oldest evicted first), and continues the match with the token that followed most of its
occurrences, then the one that followed most of those, while the product of those frequencies stays above
`min_token_prob`; a match of m tokens drafts at most `spec_factor * m`. So a long, unanimous match (code
being re-emitted, an agent repeating a tool call) drafts long, and a short or ambiguous one drafts little.
Each drafted token carries that running frequency as its confidence.

The paper keeps suffix trees. Here a context is a numpy array searched directly: occurrences of the last
token, narrowed one token further back at a time. Contexts are thousands of tokens and the cache is capped
(`max_cached_tokens`), so a lookup costs tens of microseconds, and nothing is stored per substring.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from specserve.step_types import DraftOffer, Proposal, ScheduledSeq
from specserve.spec_decode.config import SUFFIX
from specserve.spec_decode.lookup import lookup_proposal

SEPARATOR = -1  # between documents of the cache: no match crosses it
FEW = 64  # candidates few enough to compare all at once (and followers to count in Python)


class Tokens:
    """A growing token list mirrored as int32 (amortized doubling): a request's prompt and output."""

    def __init__(self):
        self.array = np.empty(256, dtype=np.int32)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        """The mirror of `tokens` (which only ever grows), brought up to date; a view of its `size` tokens."""
        n = len(tokens)
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int32)
            grown[:self.size] = self.array[:self.size]
            self.array = grown
        if n > self.size:
            self.array[self.size:n] = tokens[self.size:n]
            self.size = n
        return self.array[:n]


def longest_match(haystack: np.ndarray, context: np.ndarray, max_depth: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest m <= max_depth such that context's last m tokens occur in haystack followed by
    a token, and the end (exclusive) of each such occurrence: haystack[end] is what followed it. (0, []) if
    the last token never occurs with a continuation."""
    ends = np.flatnonzero(haystack[:-1] == context[-1]) + 1  # candidates matching 1 token
    if not len(ends):
        return 0, ends
    m, limit = 1, min(max_depth, len(context))
    while len(ends) > FEW and m < limit:  # a common suffix: narrow it a token at a time
        back = ends - m - 1  # the token one further back of each candidate
        ok = back >= 0
        ok[ok] = haystack[back[ok]] == context[-m - 1]
        if not ok.any():
            return m, ends
        ends, m = ends[ok], m + 1
    if m < limit:  # few candidates left: each one's match length in one pass
        depth = np.arange(m, limit)
        back = ends[:, None] - 1 - depth[None, :]  # [candidates, depths still to compare]
        same = (back >= 0) & (haystack[np.maximum(back, 0)] == context[-1 - depth][None, :])
        lengths = m + np.where(same.all(axis=1), len(depth), same.argmin(axis=1))
        m = int(lengths.max())
        ends = ends[lengths == m]
    return m, ends


def continue_match(sources: list[tuple[np.ndarray, np.ndarray]], limit: int, min_prob: float
                   ) -> tuple[list[int], list[float]]:
    """Follow the matched occurrences ((haystack, ends) pairs) forward: at each position the token that follows
    most of them, kept while the product of those shares stays >= min_prob. Returns the tokens and each one's
    running product (its confidence)."""
    tokens, confidences, p = [], [], 1.0
    while len(tokens) < limit:
        following = [hay[ends] for hay, ends in sources]
        allowed = np.concatenate(following)
        allowed = allowed[allowed != SEPARATOR]
        if not len(allowed):
            break
        if len(allowed) <= FEW:  # the usual case: a handful of occurrences, counted without numpy's sort
            token, count = Counter(allowed.tolist()).most_common(1)[0]
        else:
            values, counts = np.unique(allowed, return_counts=True)
            token, count = int(values[counts.argmax()]), int(counts.max())
        p *= count / len(allowed)
        if p < min_prob:
            break
        tokens.append(token)
        confidences.append(float(p))
        # The occurrences that continue with it, one token on (each haystack ends with a separator or is
        # the context itself, whose last position never matches: ends stay within bounds).
        sources = [(hay, ends[hay[ends] == token] + 1) for hay, ends in sources]
        sources = [(hay, ends[ends < len(hay)]) for hay, ends in sources]
    return tokens, confidences


@dataclass(slots=True)
class SuffixOptions:
    """vLLM's `suffix_decoding_*` options, and the cache's token budget."""
    max_depth: int = 64            # suffix_decoding_max_tree_depth: the longest match considered
    max_cached_requests: int = 1000  # suffix_decoding_max_cached_requests: finished outputs kept (0: none)
    max_cached_tokens: int = 1 << 18  # and at most this many tokens of them (1 MiB of int32)
    spec_factor: float = 1.0       # suffix_decoding_max_spec_factor: a match of m tokens drafts <= factor * m
    min_token_prob: float = 0.1    # suffix_decoding_min_token_prob: stop where the running share falls below


class OutputCache:
    """Outputs of finished requests, oldest evicted first: one int32 array of documents, each followed by a
    separator, rebuilt when documents are added or dropped (a request's end, not a step)."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.documents: list[np.ndarray] = []
        self.haystack = np.full(1, SEPARATOR, dtype=np.int32)
        self.version = 0  # changes with the haystack: occurrences found in an older one are void

    def add(self, tokens: np.ndarray) -> None:
        if not self.max_requests or not len(tokens):
            return
        self.documents.append(np.append(tokens[-self.max_tokens + 1:], SEPARATOR).astype(np.int32))
        size = sum(map(len, self.documents))
        while len(self.documents) > self.max_requests or size > self.max_tokens:
            size -= len(self.documents.pop(0))
        self.haystack = np.concatenate([np.full(1, SEPARATOR, dtype=np.int32), *self.documents])
        self.version += 1


class SuffixProposer:
    """Suffix decoding as a proposer of its own (`"method": "suffix"`), or as the free lookup of a model
    draft's proposer. Deterministic drafts known on the host, like prompt lookup's."""

    name = SUFFIX
    has_cache = False
    reads_target_hidden = False

    def __init__(self, options: SuffixOptions, device="cpu"):
        self.options = options
        self.device = torch.device(device)
        self.contexts: dict[str, Tokens] = {}  # request id -> its prompt and output as int32
        self.prompt_lengths: dict[str, int] = {}
        self.cache = OutputCache(options.max_cached_requests, options.max_cached_tokens)
        self.hits: dict[str, tuple[int, int, list[int], list[float]]] = {}  # id -> (length, k, tokens, confidences)
        self.matches: dict[str, tuple] = {}  # id -> (context length, match length, [(source, ends)], cache version)

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], confidences=False) -> Proposal:
        found = [self.hit(s.seq, s.max_drafts) if s.max_drafts else [] for s in decodes]
        proposal = lookup_proposal(found, False, self.device, SUFFIX)
        if confidences:
            rows = [self.confidences(s.seq, len(f)) + [1.0] * (proposal.token_ids.shape[1] - len(f))
                    for s, f in zip(decodes, found)]
            proposal.confidences = torch.tensor(rows, device=self.device).view(proposal.token_ids.shape)
        return proposal

    def peek(self, seq, k: int) -> DraftOffer:
        return DraftOffer(SUFFIX, len(self.hit(seq, k)), 0)

    def hit(self, seq, k: int) -> list[int]:
        """The draft for the sequence's current tokens, at most k long, remembered until it grows (the
        scheduler peeks before the policy plans, the proposer drafts after)."""
        memo = self.hits.get(seq.request_id)
        if memo is None or memo[0] != len(seq.token_ids) or memo[1] < k:
            tokens, confidences = self.lookup(seq, k)
            memo = self.hits[seq.request_id] = (len(seq.token_ids), k, tokens, confidences)
        return memo[2][:k]

    def confidences(self, seq, n: int) -> list[float]:
        """The running share of each of the first n tokens of the request's current hit."""
        return self.hits[seq.request_id][3][:n]

    def lookup(self, seq, k: int) -> tuple[list[int], list[float]]:
        """The draft (at most k tokens) and its confidences, from the longest match in the request's own
        tokens and in the cache of earlier outputs (both where the two match equally far)."""
        self.prompt_lengths.setdefault(seq.request_id, seq.num_prompt_tokens)
        context = self.contexts.setdefault(seq.request_id, Tokens()).sync(seq.token_ids)
        if not len(context) or k <= 0:
            return [], []
        m, sources = self._match(seq.request_id, context)
        if m == 0:
            return [], []
        limit = min(k, max(1, int(self.options.spec_factor * m)))
        return continue_match(sources, limit, self.options.min_token_prob)

    def _match(self, request_id: str, context: np.ndarray) -> tuple[int, list[tuple[np.ndarray, np.ndarray]]]:
        """The longest match's length and its occurrences ((haystack, ends) of each haystack holding it). Where
        the request's last match still holds after the tokens added since (the usual case while drafts are
        accepted), its occurrences are carried forward, a few array operations instead of a search; any
        match longer than the carried one would have been longer before too. Else both are searched."""
        last = self.matches.get(request_id)
        n, depth = len(context), self.options.max_depth
        if last is not None and last[3] == self.cache.version and last[0] < n:
            start, m, ends_by_source = last[0], last[1], last[2]
            new = context[start:]
            carried = []
            for source, ends in ends_by_source:
                hay = context if source == "own" else self.cache.haystack
                for t in new:  # occurrences followed by each new token in turn
                    ends = ends[ends < len(hay)]
                    ends = ends[hay[ends] == t] + 1
                carried.append((source, ends[ends < len(hay)]))
            if any(len(ends) for _, ends in carried):
                m = min(m + len(new), depth)
                self.matches[request_id] = (n, m, carried, self.cache.version)
                return m, [(context if s == "own" else self.cache.haystack, e) for s, e in carried if len(e)]
        found = [(source, hay, *longest_match(hay, context, depth))
                 for source, hay in (("own", context), ("cache", self.cache.haystack))]
        m = max(length for _, _, length, _ in found)
        best = [(source, ends) for source, _, length, ends in found if length == m and m > 0]
        self.matches[request_id] = (n, m, best, self.cache.version)
        return m, [(context if s == "own" else self.cache.haystack, e) for s, e in best]

    def on_commit(self, seq, num_committed: int) -> None:
        pass

    def forget_outputs(self) -> None:
        """Empty the cache of earlier outputs (LLM.reset_prefix_cache)."""
        self.cache = OutputCache(self.options.max_cached_requests, self.options.max_cached_tokens)
        self.matches.clear()

    def reset(self, request_id: str) -> None:
        pass  # a hit depends on the tokens only, which preemption keeps

    def free(self, request_id: str) -> None:
        """The request finished (or was aborted): its output joins the cache of earlier outputs."""
        self.hits.pop(request_id, None)
        self.matches.pop(request_id, None)
        context = self.contexts.pop(request_id, None)
        prompt = self.prompt_lengths.pop(request_id, None)
        if context is not None:
            self.cache.add(context.array[prompt:context.size])
