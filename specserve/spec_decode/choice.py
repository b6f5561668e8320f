"""Which proposer drafts a request this step, where a draft model has model-free proposers beside it
(`"ngram_first"`, `"suffix_first"`): a free hit (prompt lookup, suffix decoding: no forward) wins over the
model, which drafts only where no free proposer finds anything; between free hits, the one predicted to
get the most tokens accepted,

    E = Σ_{j<=L} Π_{i<=j} a_i

L the hit's length, a_i the acceptance the engine's acceptance model predicts for the source at position i
for this request: the positions' measured acceptance, learned online from what the target accepted of each
source, scaled by the request's own history with it (what the policy will predict when it plans). The
policy then plans the chosen source's length (design.md §3.4, §3.6).

Pricing the model against the free hits by predicted tokens per second was tried and lost to this rule on
code, chat and multi-turn code editing at one request (docs/experiments/speculation-that-pays.md): the
policy prices the model's forwards anyway, and per-request pricing cost host time every step.
"""
from __future__ import annotations

from specserve.spec_decode.config import FREE

REFRESH = 16  # observations between refreshes of the cached position acceptance


class DraftChoice:
    def __init__(self, models=None):
        """models: the engine's SpeculationModels (its acceptance model); None: the first free hit wins."""
        self.models = models
        self._cache: dict = {}  # source -> (position acceptance, global acceptance), per REFRESH observations
        self._version = None

    def expected(self, request_id: str, source: str, length: int) -> float:
        """E: the tokens a draft of `length` from `source` is predicted to get accepted."""
        acceptance = self.models.acceptance
        if acceptance.version // REFRESH != self._version:  # a step moves the estimates little
            self._cache, self._version = {}, acceptance.version // REFRESH
        if source not in self._cache:
            self._cache[source] = (acceptance.position_acceptance(source).tolist(),
                                   acceptance.global_acceptance(source))
        positions, base = self._cache[source]
        factor = acceptance.request_factor(request_id, source, base)
        e, survive = 0.0, 1.0
        for x in positions[:length]:
            survive *= min(max(x * factor, 0.0), 0.99)
            e += survive
        return e

    def pick(self, request_id: str, offers: list[tuple[str, int]]) -> int:
        """The index of the winning offer, (source, length) each: free sources in their configured order, a
        model draft, if any, last (length: the ceiling)."""
        free = [i for i, (source, length) in enumerate(offers) if length and source in FREE]
        if not free:
            return len(offers) - 1
        if self.models is None or len(free) == 1:
            return free[0]
        expected = [self.expected(request_id, *offers[i]) for i in free]
        return free[expected.index(max(expected))]
