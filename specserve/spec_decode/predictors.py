"""What a model-based policy predicts with: the step cost model and the acceptance model, both fed by the
engine after every step, whichever policy runs. The cost model's profile writes into the KV cache: the
engine builds it at startup (for a policy with `uses_cost_model`, or a default TPOT SLO), never later."""
from __future__ import annotations

import numpy as np

from specserve.batch import BatchView, StepFeedback
from specserve.spec_decode.acceptance_model import AcceptanceModel
from specserve.spec_decode.allocation import StepCosts
from specserve.spec_decode.config import NGRAM
from specserve.spec_decode.cost_model import StepCostModel


class SpeculationModels:
    def __init__(self, max_drafts: int, profile):
        """profile() -> StepCostModel: the startup sweep (or its cached result)."""
        self.acceptance = AcceptanceModel(max_drafts)
        self._profile = profile
        self._cost: StepCostModel | None = None

    def profile(self) -> None:
        """Build the cost model (the engine calls this before any request runs)."""
        if self._cost is None:
            self._cost = self._profile()

    @property
    def cost(self) -> StepCostModel:
        if self._cost is None:
            raise RuntimeError("the step cost model was not profiled at startup: a policy that reads it must "
                               "set uses_cost_model")
        return self._cost

    @property
    def has_cost(self) -> bool:
        return self._cost is not None

    def step_time(self, rows, kv_tokens):
        """Seconds of target forwards over `rows` rows (None where the cost model was not profiled)."""
        return self._cost.verify_time(rows, kv_tokens) if self._cost is not None else None

    def step_costs(self, batch: BatchView) -> StepCosts:
        """The cost curves of this step: target forward by rows, each draft's forward by rows."""
        cost = self.cost
        n = len(batch)
        base = n + batch.pending_prefill
        rows = np.arange(base + n * batch.max_drafts + 1)
        verify = cost.verify_curve(rows, batch.context_tokens + rows - base)
        mean_context = batch.context_tokens / max(n, 1)
        draft_rows = np.arange(n + sum(max(r.draft_rows - 1, 0) for r in batch.requests) + 1)  # catch-up too
        drafts = {name: np.maximum.accumulate(cost.draft_time(name, draft_rows, draft_rows * mean_context))
                  for name in self._serving(batch)}
        shared = 0.0
        if batch.pending_prefill and n:  # the prefill chunk's share: the step with it minus the decodes alone
            shared = max(0.0, float(verify[base] - cost.verify_time(n, batch.context_tokens)[0]))
        weight = (n + batch.num_waiting + batch.num_prefilling) / max(n, 1)  # docs/design.md §3.1
        return StepCosts(verify, drafts, base, shared, weight)

    def _serving(self, batch: BatchView) -> list[str]:
        """The drafts whose cost the batch's plan needs: those serving its requests, and the first draft for a
        request no draft has served yet (allocation.py costs it so); not every loaded draft."""
        names = sorted(self.cost.drafts)
        wanted = {r.draft for r in batch.requests}
        if names and any(d != NGRAM and d not in self.cost.drafts for d in wanted):
            wanted.add(names[0])
        return [name for name in names if name in wanted]

    def observe(self, feedback: StepFeedback) -> float | None:
        """Learn from a step; returns the step time (draft + forward) the cost model had predicted for it."""
        for outcome in feedback.outcomes:
            self.acceptance.observe(outcome)
        if self._cost is None:
            return None
        return self._cost.observe(feedback.num_verify_tokens + feedback.num_prefill_tokens, feedback.forward_kv,
                                  feedback.times.forward, feedback.draft_forwards, feedback.times.draft)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
