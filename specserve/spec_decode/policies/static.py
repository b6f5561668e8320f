"""`static`: every request drafts num_speculative_tokens (vLLM's behaviour); the scheduler shortens a draft
only where fewer tokens can be committed or fit."""
from __future__ import annotations

from specserve.spec_decode.policies.base import Policy, register


@register("static")
class Static(Policy):
    def plan(self, batch) -> list[int]:
        return [self.max_drafts] * len(batch)
