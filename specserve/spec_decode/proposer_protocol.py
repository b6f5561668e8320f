"""What every proposer offers the engine (draft model, EAGLE, prompt lookup, suffix decoding, a router
between drafts): the protocol the engine, the scheduler and the router are written against.

A proposer's per-request state (cache rows computed, lookup hits, EAGLE features) is its own, in tables keyed
by request id; it reads a request's tokens and block table and writes nothing of the request (§5.3).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from specserve.step_types import DraftOffer, Proposal, ScheduledSeq


@runtime_checkable
class Proposer(Protocol):
    has_cache: ClassVar[bool]  # it keeps its own KV cache: prompt chunks are mirrored into it as the target runs them
    reads_target_hidden: ClassVar[bool]  # it reads the target's hidden states (EAGLE): tapped to `observe_target`

    def peek(self, seq, k: int) -> DraftOffer:  # seq: the request (engine/sequence.py), read only
        """Before planning: which draft would serve the request this step, the most it offers, its first
        forward's rows."""

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq],
                confidences: bool = False) -> Proposal:
        """Drafts for the decodes, `max_drafts` each at most (and the prefills mirrored into its cache)."""

    def on_commit(self, seq, num_committed: int) -> None:
        """After verification: which of its cache rows stay valid."""

    def reset(self, request_id: str) -> None:
        """The request was preempted: its cache rows are gone."""

    def forget_outputs(self) -> None:
        """Forget what earlier requests left behind (suffix decoding's cache)."""

    def free(self, request_id: str) -> None:
        """The request finished or was aborted: forget it."""
