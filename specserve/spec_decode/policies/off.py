"""`off`: no drafting at all, on the same engine as every other policy (the plain-decoding baseline)."""
from __future__ import annotations

from specserve.spec_decode.policies.base import Policy, register


@register("off")
class Off(Policy):
    def plan(self, batch) -> list[int]:
        return [0] * len(batch)
