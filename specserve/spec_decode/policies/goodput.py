"""`goodput`: SmartSpec's rule. Every step, one draft length for the whole batch: the k that maximises
expected committed tokens per predicted second of the whole step, with one global acceptance rate α for
every request and position (docs/design.md §3.1). As SmartSpec, it charges the decodes the whole step
(a prefill chunk in it included) and ignores the queue: `adaptive` corrects both."""
from __future__ import annotations

import dataclasses

import numpy as np

from specserve.spec_decode.allocation import evaluate
from specserve.spec_decode.policies.base import Policy, register


@register("goodput")
class Goodput(Policy):
    uses_cost_model = True

    def plan(self, batch) -> list[int]:
        if not len(batch):
            return []
        alpha = self.models.acceptance.global_acceptance()
        costs = dataclasses.replace(self.models.step_costs(batch), shared=0.0, weight=1.0)
        b, best, best_rate = len(batch), 0, 0.0
        drafts = [r.draft for r in batch.requests]
        for k in range(self.max_drafts + 1):
            c = np.tile(alpha ** np.arange(1, self.max_drafts + 1), (b, 1))
            rate = evaluate(c, [k] * b, drafts, costs).goodput
            if rate > best_rate:
                best, best_rate = k, rate
        return [best] * b
