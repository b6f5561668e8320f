"""`threshold`: draft up to the ceiling, stopping a request's draft at the first token the draft is less
sure of than `threshold` (SpecServe's confidence baseline, 0.6)."""
from __future__ import annotations

from specserve.spec_decode.policies.base import Policy, register


@register("threshold")
class Threshold(Policy):
    stepwise = True

    def __init__(self, max_drafts: int, threshold: float = 0.6):
        super().__init__(max_drafts)
        self.threshold = float(threshold)

    def plan(self, batch) -> list[int]:
        return [self.max_drafts] * len(batch)

    def keep_drafting(self, step, requests, confidences) -> list[bool]:
        return [c[-1] >= self.threshold for c in confidences]

    def trim(self, batch, lengths, confidences) -> list[int]:
        """Drop a draft's tail from its first unsure token on (it was drafted only if it came last)."""
        return [next((j for j, c in enumerate(conf) if c < self.threshold), n) for conf, n in zip(confidences, lengths)]
