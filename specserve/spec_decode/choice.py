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


class DraftChoice:
    def __init__(self, models=None):
        """models: the engine's SpeculationModels (acceptance, step cost); None: the first free hit wins."""
        self.models = models

    def expected(self, request_id: str, source: str, length: int, confidences=None) -> float:
        """E: the tokens a draft of `length` from `source` is predicted to get accepted."""
        if length <= 0:
            return 0.0
        a = self.models.acceptance.predict(request_id, source, confidences)[:length]
        return float(np.cumprod(a).sum())

    def pick(self, request_id: str, context_len: int, offers: list[tuple[str, int, list[float] | None, int]]) -> int:
        """The index of the winning offer: (source, length, confidences or None, rows of its first draft
        forward) each, free sources first in their configured order and a model draft, if any, last (length:
        the ceiling; rows: 1 plus the catch-up of its cache)."""
        if self.models is None:
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
                seconds = float(cost.verify_time(1 + length, context_len + length)[0])
                if source not in FREE:  # the first draft step runs `rows` rows, later ones one each
                    steps = np.ones(length)
                    steps[0] = rows
                    seconds += float(cost.draft_time(source, steps, steps * context_len).sum())
                rate = (1 + e) / seconds
            if rate > best_rate:
                best, best_rate = i, rate
        return best
