"""Which proposer drafts a request this step: prompt lookup, suffix decoding or the draft model.

Lookup and suffix decoding cost no forward; the draft model costs its forwards. Each step, before the policy
plans, every model-free proposer is asked for its draft of the request, and the source predicted to commit
the most tokens per second wins:

    rate(source) = (1 + E) / (T_verify(1 + L) + T_draft(L)),   E = Σ_{j<=L} Π_{i<=j} a_i

where L is the draft's length (a hit's, or the ceiling for the model), a_i the acceptance the engine's
acceptance model predicts for the source at position i for this request (learned online from what the
target accepted of each source, calibrated by the suffix draft's own confidences), and T the step cost
model's times (T_draft = 0 for the free sources). Without a step cost model (policies that do not profile
it) the times are unknown: the model draft is chosen only where its E is higher, the free source winning
ties. The policy then plans the chosen source's length as before (design.md §3.4).
"""
from __future__ import annotations

import numpy as np

from specserve.spec_decode.config import FREE

MAX_ROWS = 64          # verify rows priced (a request's 1 + draft length; beyond: as 64)
MAX_DRAFT_ROWS = 512   # a first draft forward's rows priced (its catch-up; beyond: as 512)
CONTEXT_BUCKET = 256   # step times are read at the middle of the request's bucket of context


class DraftChoice:
    def __init__(self, models=None):
        """models: the engine's SpeculationModels (acceptance, step cost); None: the first free hit wins."""
        self.models = models
        self._cache: dict = {}  # per acceptance version: each source's position acceptance, step times
        self._version = None

    def expected(self, request_id: str, source: str, length: int, confidences=None) -> float:
        """E: the tokens a draft of `length` from `source` is predicted to get accepted."""
        acceptance = self.models.acceptance
        if confidences:
            a = acceptance.predict(request_id, source, confidences)[:length].tolist()
        else:  # the position's measured acceptance, scaled by the request's own history (no numpy per request)
            positions, base = self._cached(("positions", source), lambda: (
                acceptance.position_acceptance(source).tolist(), acceptance.global_acceptance(source)))
            factor = acceptance.request_factor(request_id, source, base)
            a = [min(max(x * factor, 0.0), 0.99) for x in positions[:length]]
        e, survive = 0.0, 1.0
        for x in a:
            survive *= x
            e += survive
        return e

    def pick(self, request_id: str, context_len: int, offers: list[tuple[str, int, list[float] | None, int]]) -> int:
        """The index of the winning offer: (source, length, confidences or None, rows of its first draft
        forward) each, free sources first in their configured order and a model draft, if any, last (length:
        the ceiling; rows: 1 plus the catch-up of its cache)."""
        if self.models is None or sum(1 for o in offers if o[1]) < 2:
            return next((i for i, (_, length, _, _) in enumerate(offers) if length), len(offers) - 1)
        best, best_rate = len(offers) - 1, -1.0
        cost = self.models.cost if self.models.has_cost else None
        for i, (source, length, confidences, rows) in enumerate(offers):
            if not length:
                continue
            e = self.expected(request_id, source, length, confidences)
            if cost is None:
                rate = e + (1e-9 if source in FREE else 0.0)  # ties: the free draft
            else:
                seconds = self._verify(cost, context_len)[min(1 + length, MAX_ROWS)]
                if source not in FREE:  # the first draft step runs `rows` rows, later ones one each
                    first, later = self._draft(cost, source, context_len, rows)
                    seconds += first + (length - 1) * later
                rate = (1 + e) / seconds
            if rate > best_rate:
                best, best_rate = i, rate
        return best

    def _cached(self, key, make):
        """make() once per version of what the engine has learned (every step's outcomes change it)."""
        version = (self.models.acceptance.version, self.models.cost.observed if self.models.has_cost else None)
        if version != self._version:
            self._cache, self._version = {}, version
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _verify(self, cost, context_len: int) -> list[float]:
        """Target forward seconds by rows 0..MAX_ROWS at about this context (a bucket of CONTEXT_BUCKET)."""
        bucket = context_len // CONTEXT_BUCKET * CONTEXT_BUCKET + CONTEXT_BUCKET // 2
        rows = np.arange(MAX_ROWS + 1)
        return self._cached(("verify", bucket), lambda: cost.verify_curve(rows, bucket + rows).tolist())

    def _draft(self, cost, source: str, context_len: int, rows: int) -> tuple[float, float]:
        """(seconds of the first draft forward of `rows` rows, of each later one-row forward)."""
        bucket = context_len // CONTEXT_BUCKET * CONTEXT_BUCKET + CONTEXT_BUCKET // 2
        grid = self._cached(("draft", source, bucket), lambda: cost.draft_time(
            source, np.arange(MAX_DRAFT_ROWS + 1), np.arange(MAX_DRAFT_ROWS + 1) * bucket).tolist())
        return grid[min(rows, MAX_DRAFT_ROWS)], grid[1]
