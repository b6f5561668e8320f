"""Shared by the policy tests and the host-sync test: the built-in policies with options that run on the tiny
models, and a fixed step cost model. (Not a test module: imported under one name only, so that the test
policies registered in test_policies.py are registered once.)"""
from pathlib import Path

import numpy as np

from specserve.spec_decode.cost_model import KNOTS, LinearCost, StepCostModel

LATENCY20 = Path(__file__).parents[2] / "bench" / "results" / "latency20" / "model.json"
BUILT_IN = [("off", None), ("static", None), ("batch_table", {"table": [[1, 4], [4, 2], [8, 0]]}),
            ("threshold", None), ("goodput", None), ("adaptive", None),
            ("planned", {"model": str(LATENCY20), "window": 1000.0})]  # a light load


class FixedCost(StepCostModel):
    """A step cost model with given costs that does not learn from measured steps."""

    def __init__(self, verify: float, per_row: float, draft: float, drafts: list[str]):
        n = len(KNOTS) + 2  # the row basis, its ramp, the KV feature
        w_verify = np.zeros(n)
        w_verify[:len(KNOTS)] = verify + per_row * KNOTS
        w_draft = np.zeros(n)
        w_draft[:len(KNOTS)] = draft
        super().__init__(LinearCost(w_verify), {name: LinearCost(w_draft) for name in drafts})

    def observe(self, *args) -> float:
        return 0.0


def cheap_drafts(llm) -> FixedCost:
    # so cheap that drafting pays even with thousands of requests queued (each added second is charged
    # once per request it delays)
    return FixedCost(verify=0.010, per_row=1e-7, draft=1e-5, drafts=list(llm.engine.models.cost.drafts))
