"""The speculation policy protocol: how many tokens each request drafts, decided once per step.

The engine calls a policy at two points of a step (docs/design.md §3.4):

1. `plan(batch)` -> draft lengths, one per decode of the step, before anything is drafted. `batch` is a
   read-only BatchView: per request its id, context length, tokens left, live acceptance statistics
   (including the length it drafted last step), which draft serves it; for the step the token budget left
   and the free KV slots.
2. `observe(feedback)` after verification: per request the drafted and accepted counts (per-position
   outcomes via `DraftOutcome.outcomes`) and, if `wants_confidences`, the draft's probability of each
   token it drafted; the step's measured phase times and token counts.

A policy that never drafts (`off`) sets `may_draft = False` and is called at neither point: the step then
builds no view and looks nothing up, and costs what plain decoding's does.

The lengths `plan` returns are final: drafting reads nothing back from the device, so the step keeps its
one device->host read (the sampler's; on a GPU each further read stalls the pipeline). What a decision
needs of the past is in the view and the engine's shared models (acceptance, cost); a policy's own state
is what it learns in `observe` and, written only by itself in `plan`, its record of its latest plan:
`last_plan`, a model-based policy's predictions (the scheduler hands them on in the StepPlan, for the
step's stats), and e.g. `adaptive`'s quiet window (steps it skips planning while the batch is unchanged).

The policy never has to clamp: the scheduler cuts every length to [0, max_drafts] and to what the
proposer can offer (`RequestView.max_drafts`: a prompt-lookup hit's length), to what the request can
still commit (max_tokens, max_model_len), to the step's token budget and to the free KV slots, in that
order, after `plan`. `RequestView.draft` is the draft that will serve the request this step ("ngram"
where prompt lookup found a hit: no draft forward to pay). Draft confidences are computed only for
policies that set `wants_confidences`.

A new policy is one file: subclass Policy, decorate it with `@register("name")`, and select it with
`"policy": "name"` in `--speculative-config` (its options go in `"policy_options"`). Worked example —
draft long only while the batch is small, since each drafted token costs more as the batch grows:

    from specserve.spec_decode.policies import Policy, register

    @register("small_batch")
    class SmallBatch(Policy):
        def __init__(self, max_drafts: int, models=None, max_batch: int = 4):
            super().__init__(max_drafts, models)
            self.max_batch = max_batch

        def plan(self, batch):
            k = self.max_drafts if len(batch) <= self.max_batch else 0
            return [k] * len(batch)

    # --speculative-config '{"model": "default", "policy": "small_batch", "policy_options": {"max_batch": 8}}'
"""
from __future__ import annotations

from specserve.step_types import BatchView, StepFeedback


class Policy:
    name = "policy"
    wants_confidences = False  # compute draft confidences and hand them to observe()
    uses_cost_model = False    # the engine profiles the step cost model at startup for it
    may_draft = True           # False: plan() is never asked (no batch view, no lookups, nothing to observe)
    last_plan = None           # a model-based policy's Allocation of its latest plan() (None: it made none);
    # the scheduler hands it on in the StepPlan, for the step's stats

    def __init__(self, max_drafts: int, models=None):
        """models: the engine's SpeculationModels (spec_decode/speculation_models.py: step cost, acceptance),
        which model-based policies read; None for a policy built without an engine."""
        self.max_drafts = max_drafts
        self.models = models

    def plan(self, batch: BatchView) -> list[int]:
        raise NotImplementedError

    def observe(self, feedback: StepFeedback) -> None:
        pass


POLICIES: dict[str, type[Policy]] = {}  # name -> class, filled by @register


def register(name: str):
    """Class decorator: make a Policy subclass selectable as `"policy": name`."""
    def add(cls: type[Policy]) -> type[Policy]:
        cls.name = name
        POLICIES[name] = cls
        return cls
    return add
