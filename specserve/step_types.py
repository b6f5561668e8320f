"""The types one engine step passes between its parts: scheduler, speculation policy, proposers, runner and
sampler. Both `engine/` and `spec_decode/` import them from here, so neither imports the other's internals.

A step in these terms (engine/llm_engine.py):

    plan = scheduler.schedule(policy)     # StepPlan: decodes (with draft budgets) and prefill chunks
    result = executor.execute(plan)       # StepResult: committed tokens per sampling row, phase times
    verdicts = outputs.check(...)         # detokenize, find stops (engine/output_processor.py)
    scheduler.update(plan, result, verdicts)   # commit tokens, finish requests, release KV
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:  # the request a step schedules, named for the reader: these types sit below the engine
    from specserve.engine.sequence import Sequence, SpecStats


@dataclass(slots=True)
class ForwardItem:
    """One sequence's new tokens in a batched forward over the paged KV cache."""
    token_ids: list[int]    # new tokens known on the host, followed by `num_device_tokens` more
    ctx_len: int            # sequence length including all new tokens
    block_table: list[int]
    num_logits: int         # logits wanted for the last `num_logits` new tokens (0..num_tokens)
    num_device_tokens: int = 0  # new tokens that live on the device (drafts), read from `device_ids`

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_device_tokens


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_tokens: int      # target tokens fed this step (prefill chunk length, or 1 for a decode)
    max_drafts: int = 0  # draft tokens this decode may carry (policy's choice after the scheduler's clamps)


# ---- what a speculation policy sees and hears (spec_decode/policies/) ----------------------------------------

class DraftOffer(NamedTuple):
    """What a proposer would draft a request with this step, asked before planning (`peek`)."""
    draft: str | None      # the draft's name; "ngram": a prompt-lookup hit, which costs no draft forward
    most: int | None       # the most drafts it can offer (a lookup hit's length; None: up to the ceiling)
    first_rows: int = 1    # rows its draft forward runs for the request at the first draft step: 1, plus
                           # the positions its draft cache has not seen (catch-up after steps without
                           # drafting); 0 for a lookup hit



@dataclass(slots=True, frozen=True)
class RequestView:
    """One running decode, as a policy sees it (read-only)."""
    request_id: str
    context_len: int     # tokens in the sequence so far (prompt + output)
    tokens_left: int     # tokens it may still commit (max_tokens and max_model_len); drafts beyond
                         # tokens_left - 1 are cut by the scheduler anyway
    spec: SpecStats      # its live speculation counters (drafts, accepted, per position, last length): read only
    draft: str | None    # the draft that would serve it this step (a draft's name; "ngram": a prompt-lookup
                         # hit, which costs no draft forward)
    greedy: bool
    slo_tpot: float | None = None  # seconds per output token the request asks for, if any
    max_drafts: int | None = None  # the most drafts its proposer can offer this step (a lookup hit's length;
                                   # None: up to the ceiling); the scheduler clamps to it
    draft_rows: int = 1  # rows of the first draft forward drafting it would cost (DraftOffer.first_rows)


@dataclass(slots=True, frozen=True)
class BatchView:
    """The step's decodes, before drafting."""
    requests: list[RequestView]
    max_drafts: int      # the configured ceiling on any request's draft length
    token_budget: int    # tokens the step may add beyond one per decode (shared with prefill chunks)
    kv_free_slots: int   # free KV cache slots after each decode's own token
    num_waiting: int     # requests not yet admitted
    pending_prefill: int = 0  # prompt tokens waiting to be prefilled, up to the token budget
    num_prefilling: int = 0   # admitted requests whose prompt is still being prefilled

    def limits(self) -> list[int]:
        """Per request, the most it may draft: the ceiling, its proposer's offer and what it can still commit
        (the scheduler's per-request clamps; the step's token budget and KV slots come after)."""
        return [max(0, min(self.max_drafts if r.max_drafts is None else r.max_drafts, r.tokens_left - 1))
                for r in self.requests]

    @property
    def context_tokens(self) -> int:
        """KV tokens the decodes' attention reads."""
        return sum(r.context_len for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class DraftOutcome:
    """How verification went for one request's draft."""
    request_id: str
    draft: str | None         # the proposer that drafted it ("ngram" for a prompt-lookup proposal)
    num_drafted: int          # l: draft tokens verified
    num_accepted: int         # n <= l: leading drafts the target accepted
    confidences: list[float] | None  # the draft's probability of each drafted token (if the policy asked)

    @property
    def outcomes(self) -> list[bool]:
        """Per position, accepted or rejected; positions after the first rejection are never tested."""
        return [True] * self.num_accepted + ([False] if self.num_accepted < self.num_drafted else [])


@dataclass(slots=True)
class PhaseTimes:
    """Seconds spent in each phase of a step, measured on the host."""
    schedule: float = 0.0
    draft: float = 0.0
    forward: float = 0.0  # the target forward (verify pass when drafts are present)
    sample: float = 0.0   # sampling and rejection sampling, including the step's one device->host transfer
    update: float = 0.0   # commit, detokenize, outputs
    grammar: float = 0.0  # of draft and sample: structured output's draft cuts and masks (not in total)

    @property
    def total(self) -> float:
        return self.schedule + self.draft + self.forward + self.sample + self.update


@dataclass(slots=True)
class StepFeedback:
    """What a policy's `observe` receives after every step that had decodes."""
    batch: BatchView
    outcomes: list[DraftOutcome]  # one per decode, in batch order
    times: PhaseTimes
    num_verify_tokens: int        # target tokens of decodes and verifies (sum of l_i + 1)
    num_prefill_tokens: int
    forward_kv: int = 0           # KV tokens the target forward's attention read (context of every row group)
    draft_forwards: list[tuple[str, int, int]] = field(default_factory=list)  # (draft, rows, KV tokens) each


# ---- what proposers return ----------------------------------------------------------------------------

@dataclass(slots=True)
class Proposal:
    """Drafts for a step's decodes, in batch order. Token ids stay on the device until verification."""
    lengths: list[int]                  # l_i drafted tokens per decode (known on the host)
    token_ids: torch.Tensor             # [N, K] target-vocabulary ids (columns past l_i are padding)
    probs: torch.Tensor | None = None   # [S, K, V] q of the sampled decodes (rows in `sampled` order); None
                                        # when every proposal is deterministic or every request greedy
    sampled: list[int] = field(default_factory=list)  # decode indices whose q rows `probs` holds
    confidences: torch.Tensor | None = None  # [N, K] the draft's probability of each drafted token
    sources: list[str | None] = field(default_factory=list)  # per decode: which proposer drafted it
    draft_forwards: list[tuple[str, int, int]] = field(default_factory=list)  # (draft, rows, KV tokens) of each
                                                                             # draft-model forward run
    # The drafts as host lists when every one was known there (prompt lookup): the target's forward takes them
    # as host tokens and greedy acceptance reads them without a transfer (on a GPU, ~5 small device ops a step).
    host_token_ids: list[list[int]] | None = None

    @classmethod
    def empty(cls, n: int, device) -> "Proposal":
        return cls([0] * n, torch.zeros(n, 0, dtype=torch.long, device=device), sources=[None] * n,
                   host_token_ids=[[] for _ in range(n)])


@dataclass(slots=True)
class StepPlan:
    """What the scheduler decided for one step."""
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    view: BatchView | None = None  # the decodes as the policy saw them (None without speculation)
    prediction: Any = None  # a model-based policy's Allocation for this step (its predictions, for the stats)
    cache_queries: int = 0  # prompt tokens of the requests admitted this step, looked up in the prefix cache
    cache_hits: int = 0     # of which found there (their KV not computed again)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(slots=True)
class StepResult:
    """What running a plan produced. `committed[i]` belongs to `sampling[i]`."""
    sampling: list[ScheduledSeq]           # decodes, then prefill chunks that completed their prompt
    committed: list[list[int]]             # tokens each commits: accepted drafts + one sampled token
    logprobs: list[list[float] | None]     # the raw log-probability of each committed token, if asked
    proposal: Proposal
    times: PhaseTimes
    forward_kv: int                        # KV tokens the target forward's attention read (all its rows)
    confidences: list[list[float]] | None = None  # per decode, if the policy asked
    top_logprobs: list | None = None       # per request: [(token, log-probability)] of each committed token, if asked
    prompt_logprobs: list = field(default_factory=list)  # (seq, first position, [{token: (logprob, rank)}])
