"""`adaptive`: per-request draft lengths that maximise the step's predicted goodput, from the step cost
model of this machine and the acceptance model (docs/design.md §3.4). The default for `serve`.

- plan: predicted acceptance per request and position (its draft's measured acceptance per position,
  scaled by the request's own history) -> the best-goodput allocation over every length (go/no-go against
  the best k, not only k = 1), kept within each request's TPOT SLO; each request priced by the draft that
  would serve it (a prompt-lookup hit is free) and by the rows its draft must catch up on first;
- hysteresis: a request keeps the length it drafted last step (`spec.last_drafted`, or the batch keeps not
  drafting) unless the new choice is predicted better by more than `margin`, so estimates' noise does not
  flip lengths every step.
The plan is final: nothing is decided on the draft's confidences mid-step, which would cost a device read
per draft step (docs/design.md §5).
"""
from __future__ import annotations

from specserve.spec_decode.allocation import allocate, evaluate, survival
from specserve.spec_decode.policies.base import Policy, register


@register("adaptive")
class Adaptive(Policy):
    uses_cost_model = True

    def __init__(self, max_drafts: int, margin: float = 0.03):
        super().__init__(max_drafts)
        self.margin = float(margin)

    def plan(self, batch) -> list[int]:
        if not len(batch):
            return []
        acceptance = self.models.acceptance
        drafts = [r.draft for r in batch.requests]
        a = acceptance.predict_batch([(r.request_id, r.draft) for r in batch.requests])[:, :self.max_drafts]
        limits = [min(n, self.max_drafts) for n in batch.limits()]
        costs = self.models.step_costs(batch)
        slos = [r.slo_tpot for r in batch.requests]
        rows = [r.draft_rows for r in batch.requests]  # a draft cache behind its request costs catch-up rows
        best = allocate(survival(a), drafts, limits, costs, tpot_slos=slos, first_rows=rows)
        held = [min(r.spec.last_drafted, n) for r, n in zip(batch.requests, limits)]
        if held != best.lengths and not any(slos):  # with objectives, the feasible choice wins outright
            kept = evaluate(survival(a), held, drafts, costs, first_rows=rows)
            if kept.goodput >= best.goodput * (1 - self.margin):
                best = kept
        self.last_plan = best
        return best.lengths
