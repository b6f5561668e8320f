"""`batch_table`: the draft length looked up by batch size, as vLLM users configure it by hand.

`"policy_options": {"table": [[1, 4], [8, 2], [16, 1], [32, 0]]}`: from each batch size on, draft that many
tokens (the default halves the ceiling at 8 and 16 running requests and stops at 32)."""
from __future__ import annotations

from specserve.errors import SpecServeError
from specserve.spec_decode.policies.base import Policy, register


@register("batch_table")
class BatchTable(Policy):
    def __init__(self, max_drafts: int, models=None, table: list | None = None):
        super().__init__(max_drafts, models)
        table = table if table is not None else [[1, max_drafts], [8, max(max_drafts // 2, 1)], [16, 1], [32, 0]]
        try:
            self.table = sorted((int(b), int(k)) for b, k in table)
        except (TypeError, ValueError):
            raise SpecServeError(f"batch_table: table must be [[batch size, k], ...], got {table!r}") from None

    def plan(self, batch) -> list[int]:
        k = 0
        for size, length in self.table:
            if len(batch) >= size:
                k = length
        return [k] * len(batch)
