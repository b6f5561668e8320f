"""`adaptive`: per-request draft lengths that maximise the step's predicted goodput, from the step cost
model of this machine and calibrated acceptance (docs/design.md §3.4). The default for `serve`.

- plan: predicted acceptance per request and position -> the best-goodput allocation over every length
  (go/no-go against the best k, not only k = 1), kept within each request's TPOT SLO;
- keep_drafting: after each draft step, the request's real confidences replace the predictions and the
  allocation is redone; a request stops at the first position that no longer pays;
- trim: with all confidences known and the drafting spent, drop the lowest-survival slots while predicted
  goodput rises;
- hysteresis: a request keeps its previous length (or the batch keeps not drafting) unless the new
  choice is predicted better by more than `margin`, so estimates' noise does not flip lengths every step.
"""
from __future__ import annotations

import numpy as np

from specserve.spec_decode.allocation import allocate, evaluate, survival
from specserve.spec_decode.policies.base import Policy, register


@register("adaptive")
class Adaptive(Policy):
    uses_cost_model = True
    stepwise = True

    def __init__(self, max_drafts: int, margin: float = 0.03):
        super().__init__(max_drafts)
        self.margin = float(margin)
        self.previous: dict[str, int] = {}  # request id -> its length last step
        self._step = None                   # this step's batch, drafts, limits, costs, acceptance rows

    def plan(self, batch) -> list[int]:
        if not len(batch):
            return []
        acceptance = self.models.acceptance
        drafts = [r.draft for r in batch.requests]
        a = np.array([acceptance.predict(r.request_id, r.draft) for r in batch.requests])[:, :self.max_drafts]
        limits = [min(n, self.max_drafts) for n in batch.limits()]
        costs = self.models.step_costs(batch)
        slos = [r.slo_tpot for r in batch.requests]
        best = allocate(survival(a), drafts, limits, costs, tpot_slos=slos)
        held = [min(self.previous.get(r.request_id, 0), n) for r, n in zip(batch.requests, limits)]
        if held != best.lengths and not any(slos):  # with objectives, the feasible choice wins outright
            kept = evaluate(survival(a), held, drafts, costs)
            if kept.goodput >= best.goodput * (1 - self.margin):
                best = kept
        self._step = (batch, drafts, best.lengths, costs, a, slos)
        return best.lengths

    def keep_drafting(self, step, requests, confidences) -> list[bool]:
        batch, drafts, limits, costs, a, slos = self._step
        index = {r.request_id: i for i, r in enumerate(batch.requests)}
        rows = [index[r.request_id] for r in requests]
        for i, r, conf in zip(rows, requests, confidences):
            a[i] = self.models.acceptance.predict(r.request_id, r.draft, conf)[:a.shape[1]]
        again = allocate(survival(a), drafts, limits, costs, tpot_slos=slos)
        return [again.lengths[i] > step for i in rows]

    def trim(self, batch, lengths, confidences) -> list[int]:
        acceptance = self.models.acceptance
        a = np.array([acceptance.predict(r.request_id, r.draft, conf)
                      for r, conf in zip(batch.requests, confidences)])
        drafts = [r.draft for r in batch.requests]
        costs = self._step[3] if self._step is not None else self.models.step_costs(batch)
        return allocate(survival(a), drafts, lengths, costs, spent_draft=True,
                        tpot_slos=[r.slo_tpot for r in batch.requests]).lengths

    def observe(self, feedback) -> None:
        self.previous = {o.request_id: o.num_drafted for o in feedback.outcomes}
