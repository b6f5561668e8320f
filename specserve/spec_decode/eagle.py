"""EAGLE proposer: a draft that reads the target's final hidden state (see specserve/distill/eagle_draft.py).

Row j of the draft reads token j and f_{j-1}, the target's hidden state at position j-1. The target
computes f for every position it runs (prefill chunks, verified tokens); the engine hands over the rows of
committed positions (`observe_target`), stored by KV cache slot (`TargetFeatures`) until the draft reads
them. Drafting step 1 ends at the last committed token, whose row reads a real f; later steps read the
draft's own prediction f̂. Rows made from f̂ are provisional: after verification the draft cache is rolled
back to the last position computed from real features, and the accepted tokens are redone next time from
the target's f (one extra row per accepted token, in the same batched forward).
"""
from __future__ import annotations

import torch

from specserve.step_types import ScheduledSeq
from specserve.spec_decode.proposer import Drafter


class TargetFeatures:
    """The target's final hidden state of every computed position, kept like its KV: one row per cache slot
    (block * block_size + offset), written as the target computes the position and valid as long as the
    block holds it. A request that drafts rarely costs no copying, and a prompt prefix taken from the prefix
    cache brings its positions' features along with their KV. One store serves every EAGLE draft of the
    engine (they read the same target); rows are allocated at the first write, in the target's dtype."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_slots, self.block_size = num_blocks * block_size, block_size
        self.rows: torch.Tensor | None = None  # [slots, hidden]

    def slots(self, block_table: list[int], first: int, last: int) -> list[int]:
        """The cache slots of positions first .. last."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(first, last + 1)]

    def write(self, entries, hidden: torch.Tensor) -> None:
        """entries: (seq, first position, first row in hidden, count) each (executor.TapEntry). As few torch
        operations as possible: right after a forward each one runs cold (~20-120 us here, against ~5 warm),
        so a plain decode step (every row kept) copies `hidden` whole, in one index_copy_."""
        slots, rows = [], []
        for seq, first, row, count in entries:
            slots += self.slots(seq.block_table, first, first + count - 1)
            rows += range(row, row + count)
        if not slots:
            return
        if self.rows is None:
            self.rows = hidden.new_zeros(self.num_slots, hidden.shape[1])
        if len(rows) != len(hidden) or rows[-1] != len(hidden) - 1:  # some rows are not kept (rejected drafts)
            hidden = hidden[torch.tensor(rows, dtype=torch.long, device=hidden.device)]
        self.rows.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=self.rows.device),
                              hidden.to(self.rows.dtype))

    def read(self, block_table: list[int], first: int, last: int) -> torch.Tensor:
        return self.rows[torch.tensor(self.slots(block_table, first, last), dtype=torch.long, device=self.rows.device)]


class EagleProposer:
    has_cache = False          # no draft prefill alongside the target's: it needs the target's features
    reads_target_hidden = True

    def __init__(self, drafter: Drafter, features: TargetFeatures | None = None):
        self.drafter = drafter
        self.runner, self.peek, self.forget_outputs = drafter.runner, drafter.peek, drafter.forget_outputs
        self.features = features or TargetFeatures(drafter.runner.num_blocks, drafter.runner.block_size)

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], confidences=False):
        # Prompt rows need the target's features: they ride in the request's first drafting forward.
        return self.drafter.propose(decodes, confidences, [], features=self._pending_features)

    def observe_target(self, entries, hidden: torch.Tensor) -> None:
        """The target's hidden states of the step's committed positions (executor.TapEntry each)."""
        self.features.write(entries, hidden)

    def _pending_features(self, seq) -> torch.Tensor:
        """f_{j-1} for every draft row j from the draft cache's end to the last token (zeros before position 0)."""
        first, last = self.drafter.computed.get(seq.request_id, 0) - 1, len(seq.token_ids) - 2
        rows = self.features.read(seq.block_table, max(first, 0), last)
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

    def free(self, request_id: str) -> None:
        self.drafter.free(request_id)
