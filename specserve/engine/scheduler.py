"""Iteration-level scheduler: decodes first, then chunked prefills, within a token budget.

Every step it (1) gives each running decode 1 token plus room for up to `max_drafts` speculative
tokens, preempting the most recently admitted request when the KV cache is full (it is recomputed
later, so nothing is lost); (2) spends the remaining token budget on prefill chunks, first for requests
already running, then for waiting ones in the order the policy gives.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

from specserve.engine.block_manager import BlockManager
from specserve.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int      # target tokens fed this step (prefill chunk length, or 1 for a decode)
    max_drafts: int = 0  # KV slots reserved for draft tokens (decodes only)


@dataclass(slots=True)
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


class FCFSPolicy:
    """Waiting requests in arrival order. An SLO-aware policy orders by deadline instead."""

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return list(waiting)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 draft_budget: Callable[[Sequence], int] = lambda seq: 0, policy=None):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.draft_budget = draft_budget  # max draft tokens a decode of this sequence may carry
        self.policy = policy or FCFSPolicy()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.in_prefill or budget < 1:
                continue
            drafts = max(0, min(self.draft_budget(seq), budget - 1))
            while not self.blocks.can_grow(seq.block_table, seq.num_computed + 1 + drafts):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.blocks.grow(seq.block_table, seq.num_computed + 1 + drafts)
            out.decodes.append(ScheduledSeq(seq, 1, drafts))
            scheduled.add(id(seq))
            budget -= 1 + drafts
        candidates = [s for s in self.running if s.in_prefill] + self.policy.order(self.waiting)
        for seq in candidates:
            if budget < 1:
                break
            waiting = seq.status == Status.WAITING
            if waiting and len(self.running) >= self.max_num_seqs:
                break
            chunk = min(len(seq.token_ids) - seq.num_computed, budget)
            if not waiting:  # a started prefill may continue with whatever room is left
                room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size
                chunk = min(chunk, room - seq.num_computed)
                if chunk < 1:
                    if out.is_empty:  # nothing else can run: free room, or this loops forever
                        self._preempt(self.running[-1], out)
                    break
            elif not self.blocks.can_grow(seq.block_table, seq.num_computed + chunk):
                break  # new requests wait rather than preempt admitted ones
            if waiting:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
            self.blocks.grow(seq.block_table, seq.num_computed + chunk)
            out.prefills.append(ScheduledSeq(seq, chunk))
            budget -= chunk
        return out

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_draft_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        out.prefills = [s for s in out.prefills if s.seq is not seq]
        out.decodes = [s for s in out.decodes if s.seq is not seq]
