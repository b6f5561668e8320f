"""What a model-based policy predicts with: the step cost model and the acceptance model, both fed by the
engine after every step, whichever policy runs. The cost model's profile writes into the KV cache: the
engine builds it at startup (for a policy with `uses_cost_model`, or a default TPOT SLO), never later."""
from __future__ import annotations

import numpy as np

from specserve.step_types import BatchView, StepFeedback
from specserve.spec_decode.acceptance_model import AcceptanceModel
from specserve.spec_decode.allocation import StepCosts
from specserve.spec_decode.config import FREE
from specserve.spec_decode.cost_model import StepCostModel


class DraftingError:
    """How much more time drafting adds to a step than the step cost model predicts, learned from the
    steps themselves. The cost model fits forwards by their rows and KV tokens; a drafting step differs in
    ways those features do not see (its rows come k + 1 to a request; the draft's forwards interleave with
    the target's), and on this engine drafting steps under a bursty mixed load took 1.26-1.48 times a plain
    step where the plan had predicted 1.20-1.31 (docs/experiments/engine-kernels-adaptive-2026-11.md). The
    allocation charges the time drafting adds (T - T_0) times `factor`, so a bias of the model cannot make
    drafting look cheaper than it turns out.

    The measured time is the forwards' and the sampling's: sampling is not in the cost model, but every
    verify row is sampled as a decode row is (at T > 0 a softmax over the vocabulary, the draws, the
    rejection test), so drafting adds it too; left out, a sampled workload's drafting looked cheaper than
    it was (mixed bursty evaluation at T = 0.7, half load: engine busy time 1.05-1.43x plain decoding's).

    Decode-only steps only: a plain one (nothing drafted, no draft forward) measures the model's bias on
    plain steps, b = Σ measured / Σ predicted; a drafting one adds measured - b T_0 to Σ added and its
    predicted T - T_0 to Σ predicted added; factor = their ratio, exponentially forgotten, shrunk towards 1
    by `prior_steps` pseudo-steps (so it returns to 1 as the evidence ages), kept within [0.5, 4]."""

    def __init__(self, forgetting: float = 0.99, prior_steps: float = 5.0):
        self.forgetting, self.prior_steps = forgetting, prior_steps
        self.plain = [0.0, 0.0]  # Σ λ^age measured, predicted of plain steps
        self.added = [0.0, 0.0, 0.0]  # Σ λ^age measured added, predicted added, drafting steps

    def observe(self, drafted: bool, measured: float, predicted: float, plain_predicted: float) -> None:
        """One decode-only step. Every step ages the drafting evidence, drafting or not: a policy that
        stopped drafting because drafting looked dear drafts again once the evidence is old, and relearns."""
        self.added = [self.forgetting * s for s in self.added]
        if not drafted:
            self.plain = [self.forgetting * s + v for s, v in zip(self.plain, (measured, predicted))]
        elif predicted > plain_predicted:
            step = (measured - self.bias * plain_predicted, predicted - plain_predicted, 1.0)
            self.added = [s + v for s, v in zip(self.added, step)]

    @property
    def bias(self) -> float:
        measured, predicted = self.plain
        return measured / predicted if predicted > 0 else 1.0

    @property
    def factor(self) -> float:
        measured, predicted, steps = self.added
        if steps <= 0:
            return 1.0
        prior = self.prior_steps * predicted / steps  # prior_steps mean drafting steps measured as predicted
        return float(min(max((measured + prior) / (predicted + prior), 0.5), 4.0))


class SpeculationModels:
    def __init__(self, max_drafts: int):
        self.acceptance = AcceptanceModel(max_drafts)
        self.drafting = DraftingError()
        self._cost: StepCostModel | None = None

    def profile(self, measure) -> None:
        """Build the cost model with measure() -> StepCostModel, the startup sweep or its cached result (the
        engine calls this before any request runs)."""
        if self._cost is None:
            self._cost = measure()

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
        return StepCosts(verify, drafts, base, shared, weight * self.drafting.factor)

    def _serving(self, batch: BatchView) -> list[str]:
        """The drafts whose cost the batch's plan needs: those serving its requests, and the first draft for a
        request no draft has served yet (allocation.py costs it so); not every loaded draft."""
        names = sorted(self.cost.drafts)
        wanted = {r.draft for r in batch.requests}
        if names and any(d not in FREE and d not in self.cost.drafts for d in wanted):
            wanted.add(names[0])
        return [name for name in names if name in wanted]

    def observe(self, feedback: StepFeedback) -> float | None:
        """Learn from a step; returns the step time (draft + forward) the cost model had predicted for it."""
        for outcome in feedback.outcomes:
            self.acceptance.observe(outcome)
        if self._cost is None:
            return None
        drafted = feedback.num_verify_tokens - len(feedback.outcomes)
        decode_only = not feedback.num_prefill_tokens and (drafted or not feedback.draft_forwards)
        if decode_only:  # the same step without its drafts, as the model saw it before learning from this one
            plain = float(self._cost.verify_time(len(feedback.outcomes), feedback.forward_kv - drafted)[0])
        predicted = self._cost.observe(feedback.num_verify_tokens + feedback.num_prefill_tokens,
                                       feedback.forward_kv, feedback.times.forward, feedback.draft_forwards,
                                       feedback.times.draft)
        if decode_only:
            measured = feedback.times.forward + feedback.times.sample + (
                feedback.times.draft if feedback.draft_forwards else 0.0)
            self.drafting.observe(bool(drafted), measured, predicted, plain)
        return predicted

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)
