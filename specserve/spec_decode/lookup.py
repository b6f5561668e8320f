"""Prompt lookup (n-gram): propose the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. Deterministic drafts known on the host, which cost no forward."""
from __future__ import annotations

import torch

from specserve.step_types import DraftOffer, Proposal, ScheduledSeq
from specserve.spec_decode.config import NGRAM


class NgramIndex:
    """The latest start of every n-gram (n in min_n..max_n) of a growing token list whose next token is
    known, updated with the tokens added since the last lookup: O(new tokens) per step, not O(length)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.latest: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.length = 0  # tokens indexed: every n-gram starting at s <= length - 1 - n is in `latest`

    def find(self, tokens: list[int], k: int) -> list[int]:
        """The (at most k) tokens that followed the latest earlier occurrence of the last n tokens, n from
        max_n down to min_n; [] when none recurs."""
        size = len(tokens)
        for n, latest in self.latest.items():
            for start in range(max(0, self.length - n), size - n):
                latest[tuple(tokens[start:start + n])] = start
        self.length = size
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            start = self.latest[n].get(tuple(tokens[size - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from max
    down to min) and propose the tokens that followed it."""

    name = NGRAM
    has_cache = False
    reads_target_hidden = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, device="cpu"):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.device = torch.device(device)
        self.indexes: dict[str, NgramIndex] = {}  # request id -> its tokens' n-grams
        self.hits: dict[str, tuple[int, int, list[int]]] = {}  # request id -> (length, k, its hit there)

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], confidences=False) -> Proposal:
        found = [self.hit(s.seq, s.max_drafts) if s.max_drafts else [] for s in decodes]
        return lookup_proposal(found, confidences, self.device)

    def peek(self, seq, k: int) -> DraftOffer:
        """Before planning: lookup offers its hit's length, nothing more, and runs no forward."""
        return DraftOffer(NGRAM, len(self.hit(seq, k)), 0)

    def hit(self, seq, k: int) -> list[int]:
        """lookup() of the sequence's tokens, at most k long, remembered until it grows: the scheduler peeks
        before the policy plans (at the ceiling) and the proposer drafts after it (at the planned length)."""
        memo = self.hits.get(seq.request_id)
        if memo is None or memo[0] != len(seq.token_ids) or memo[1] < k:
            index = self.indexes.setdefault(seq.request_id, NgramIndex(self.min_n, self.max_n))
            memo = self.hits[seq.request_id] = (len(seq.token_ids), k, self.lookup(seq.token_ids, k, index))
        return memo[2][:k]

    def lookup(self, tokens: list[int], k: int, index: NgramIndex | None = None) -> list[int]:
        """The lookup's proposal for `tokens`; `index`: the request's, brought up to date on the way."""
        return (index or NgramIndex(self.min_n, self.max_n)).find(tokens, k)

    def on_commit(self, seq, num_committed: int) -> None:
        pass

    def forget_outputs(self) -> None:
        pass  # it looks into the request's own tokens only

    def reset(self, request_id: str) -> None:
        pass  # a hit depends on the tokens only, which preemption keeps

    def free(self, request_id: str) -> None:
        self.hits.pop(request_id, None)
        self.indexes.pop(request_id, None)


def lookup_proposal(found: list[list[int]], confidences: bool, device, source: str = NGRAM) -> Proposal:
    """A Proposal of deterministic drafts known on the host (q one-hot: no probs; confidence 1), by `source`."""
    k = max(map(len, found), default=0)
    tokens = torch.tensor([f + [0] * (k - len(f)) for f in found], dtype=torch.long, device=device).view(len(found), k)
    confidences = torch.ones(len(found), k, device=device) if confidences else None
    return Proposal([len(f) for f in found], tokens, confidences=confidences,
                    sources=[source if f else None for f in found], host_token_ids=found)
