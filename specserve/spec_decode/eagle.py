"""EAGLE proposer: a draft that reads the target's final hidden state (see specserve/distill/eagle.py).

Row j of the draft reads token j and f_{j-1}, the target's hidden state at position j-1. The target
computes f for every position it runs (prefill chunks, verified tokens); the engine hands over the rows of
committed positions (`observe_target`) and they wait in a per-request buffer until the draft consumes
them. Drafting step 1 ends at the last committed token, whose row reads a real f; later steps read the
draft's own prediction f̂. Rows made from f̂ are provisional: after verification the draft cache is rolled
back to the last position computed from real features, and the accepted tokens are redone next time from
the target's f (one extra row per accepted token, in the same batched forward).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.batch import ScheduledSeq
from specserve.spec_decode.proposer import Drafter


@dataclass(slots=True)
class FeatureBuffer:
    """Target hidden states of positions start .. end - 1, in storage that grows by doubling: a request
    that drafts rarely keeps every committed position's row until it drafts, and a copy of all of them
    at every step would cost O(length) per step."""
    start: int
    storage: torch.Tensor  # [capacity, hidden]
    size: int = 0

    @property
    def end(self) -> int:
        return self.start + self.size

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start .. start + n - 1, start in [self.start, self.end]: later rows are dropped."""
        at, need = start - self.start, start - self.start + len(rows)
        if need > len(self.storage):
            grown = self.storage.new_empty(max(need, 2 * len(self.storage)), self.storage.shape[1])
            grown[:at] = self.storage[:at]
            self.storage = grown
        self.storage[at:need] = rows
        self.size = need

    def take(self, first: int, last: int) -> torch.Tensor:
        """A copy of the rows of positions first .. last; the buffer then starts empty at last + 1."""
        rows = self.storage[first - self.start:last + 1 - self.start].clone()
        self.start, self.size = last + 1, 0
        return rows


class EagleProposer:
    has_cache = False          # no draft prefill alongside the target's: it needs the target's features
    reads_target_hidden = True

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.runner, self.lookup, self.peek = drafter.runner, drafter.lookup, drafter.peek
        self.features: dict[str, FeatureBuffer] = {}  # request id -> target features not yet drafted from

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], confidences=False):
        # Prompt rows need the target's features: they ride in the request's first drafting forward.
        return self.drafter.propose(decodes, confidences, [], features=self._pending_features)

    def observe_target(self, seq, start: int, rows: torch.Tensor) -> None:
        """The target's hidden states [n, hidden] of committed positions start .. start + n - 1."""
        buf = self.features.get(seq.request_id)
        if buf is None or not buf.start <= start <= buf.end:  # first rows, or a recompute after preemption
            buf = self.features[seq.request_id] = FeatureBuffer(start, rows.new_empty(len(rows), rows.shape[1]))
        buf.write(start, rows)

    def _pending_features(self, seq) -> torch.Tensor:
        """f_{j-1} for every draft row j from the draft cache's end to the last token (zeros before position 0)."""
        first, last = self.drafter.computed.get(seq.request_id, 0) - 1, len(seq.token_ids) - 2
        buf = self.features[seq.request_id]
        assert buf.start <= max(first, 0) and last < buf.end, "EAGLE draft is missing target features"
        rows = buf.take(max(first, 0), last)  # consumed: the next rows start at len - 1
        if first < 0:
            rows = torch.cat([rows.new_zeros(1, rows.shape[1]), rows])
        return rows

    def on_commit(self, seq, num_committed: int) -> None:
        # Valid draft rows are those made from the target's features: positions before this step's
        # first committed token.
        computed = self.drafter.computed
        computed[seq.request_id] = min(computed.get(seq.request_id, 0), len(seq.token_ids) - num_committed)

    def reset(self, request_id: str) -> None:
        self.drafter.reset(request_id)
        self.features.pop(request_id, None)

    def free(self, request_id: str) -> None:
        self.reset(request_id)
        self.drafter.free(request_id)
