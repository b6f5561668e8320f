"""`threshold`: draft up to the ceiling, stopping a request's draft before the first position whose predicted
acceptance (the acceptance model's: its draft's measured acceptance there, scaled by the request's own
history) is below `threshold` (0.6, SpecServe's confidence baseline). SpecServe stops on the draft's
confidence as each token is drafted; here the length is fixed before drafting, so that the step keeps its
one device->host read (docs/design.md §5)."""
from __future__ import annotations

import numpy as np

from specserve.spec_decode.policies.base import Policy, register


@register("threshold")
class Threshold(Policy):
    def __init__(self, max_drafts: int, models=None, threshold: float = 0.6):
        super().__init__(max_drafts, models)
        self.threshold = float(threshold)

    def plan(self, batch) -> list[int]:
        lengths = []
        for r in batch.requests:
            a = self.models.acceptance.predict(r.request_id, r.draft)[:self.max_drafts]
            below = np.flatnonzero(a < self.threshold)
            lengths.append(int(below[0]) if len(below) else len(a))
        return lengths
