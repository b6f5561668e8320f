"""`adaptive`: per-request draft lengths that maximise the step's predicted goodput, from the step cost
model of this machine and the acceptance model (docs/design.md §3.4). The default for `serve`.

- plan: predicted acceptance per request and position (its draft's measured acceptance per position,
  scaled by the request's own history) -> the best-goodput allocation over every length (go/no-go against
  the best k, not only k = 1), kept within each request's TPOT SLO; each request priced by the draft that
  would serve it (a prompt-lookup hit is free) and by the rows its draft must catch up on first;
- hysteresis: a request keeps the length it drafted last step (`spec.last_drafted`, or the batch keeps not
  drafting) unless the new choice is predicted better by more than `margin`, so estimates' noise does not
  flip lengths every step.
- quiet steps: after a plan that drafted nothing because every drafting allocation was predicted to add
  tokens at a rate at least `quiet_margin` below plain decoding's, the same batch (the same requests, the greedy
  ones with the same offers) does not draft for up to `quiet_steps` more steps without planning again: a plan
  costs ~0.4 ms of host time right after a forward here, 5 % of a batch-1 step, and a few steps of new
  evidence do not move a decision that far.
The plan is final: nothing is decided on the draft's confidences mid-step, which would cost a device read
per draft step (docs/design.md §5).
"""
from __future__ import annotations

from specserve.spec_decode.allocation import allocate, evaluate, survival
from specserve.spec_decode.policies.base import Policy, register


@register("adaptive")
class Adaptive(Policy):
    uses_cost_model = True

    def __init__(self, max_drafts: int, models=None, margin: float = 0.03, quiet_margin: float = 0.1, quiet_steps: int = 8):
        super().__init__(max_drafts, models)
        self.margin, self.quiet_margin, self.quiet_steps = float(margin), float(quiet_margin), int(quiet_steps)
        self._quiet: tuple | None = None  # (the batch's key, steps left) after a confidently plain plan

    def plan(self, batch) -> list[int]:
        if not len(batch):
            return []
        # The batch's requests, and the greedy ones' offers (a lookup hit, or a longer one: copying runs, and
        # those can pay); not sampled requests' offers nor the queue: under sampling lookup hits come and go
        # from one step to the next (a key with them held a quiet window for 14 of 97 plans of a mixed batch
        # at T = 0.7, each plan ~0.6 ms of a ~15 ms step), and neither moves drafting from far below paying.
        key = tuple((r.request_id, (r.draft, r.max_drafts) if r.greedy else None) for r in batch.requests)
        if self._quiet is not None and self._quiet[0] == key and self._quiet[1] > 0:
            self._quiet = (key, self._quiet[1] - 1)
            self.last_plan = None
            return [0] * len(batch)
        self._quiet = None
        acceptance = self.models.acceptance
        drafts = [r.draft for r in batch.requests]
        a = acceptance.predict_batch([(r.request_id, r.draft) for r in batch.requests])[:, :self.max_drafts]
        limits = [min(n, self.max_drafts) for n in batch.limits()]
        costs = self.models.step_costs(batch)
        slos = [r.slo_tpot for r in batch.requests]
        rows = [r.draft_rows for r in batch.requests]  # a draft cache behind its request costs catch-up rows
        best = allocate(survival(a), drafts, limits, costs, tpot_slos=slos, first_rows=rows)
        # (a batch with nothing to draft, no lookup hit, is not one whose drafting was found far from paying)
        quiet = not any(best.lengths) and any(limits) and not any(slos) and best.drafting_rate < 1 - self.quiet_margin
        held = [min(r.spec.last_drafted, n) for r, n in zip(batch.requests, limits)]
        if held != best.lengths and not any(slos):  # with objectives, the feasible choice wins outright
            kept = evaluate(survival(a), held, drafts, costs, first_rows=rows)
            if kept.goodput >= best.goodput * (1 - self.margin):
                best = kept
        self.last_plan = best
        if quiet and not any(best.lengths):
            self._quiet = (key, self.quiet_steps)
        return best.lengths
