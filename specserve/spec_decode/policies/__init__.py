"""Speculation policies by name: `"policy"` in `--speculative-config` picks one (protocol: base.py)."""
from __future__ import annotations

from specserve.errors import SpecServeError
from specserve.spec_decode.policies.base import POLICIES, Policy, register


def make_policy(name: str, max_drafts: int, options: dict | None = None, models=None) -> Policy:
    """models: the engine's SpeculationModels (cost and acceptance), which model-based policies read."""
    if name not in POLICIES:
        raise SpecServeError(f"unknown speculation policy {name!r} (choose from {', '.join(sorted(POLICIES))})")
    try:
        return POLICIES[name](max_drafts, models=models, **(options or {}))
    except TypeError as e:  # an option the policy does not take, or a missing one
        raise SpecServeError(f"policy {name!r}: bad policy_options: {e}") from None


# The built-in policies register themselves on import.
from specserve.spec_decode.policies import (adaptive, batch_table, goodput, off, planned, static,  # noqa: E402,F401
                                            threshold)

__all__ = ["POLICIES", "Policy", "make_policy", "register"]
