"""`off`: no drafting at all, on the same engine as every other policy (the plain-decoding baseline). The
scheduler does not even build the plan's view for it (`may_draft`): no lookups, no observations, so a step
costs what it costs without speculation but for the EAGLE feature tap."""
from __future__ import annotations

from specserve.spec_decode.policies.base import Policy, register


@register("off")
class Off(Policy):
    may_draft = False

    def plan(self, batch) -> list[int]:
        return [0] * len(batch)
