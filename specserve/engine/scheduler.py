"""Iteration-level scheduler: decodes first, then chunked prefills, within a token budget.

`schedule(policy)` (1) gives each running decode its one token, preempting the most recently admitted
request when the KV cache is full (it is recomputed later, so nothing is lost); (2) asks the speculation
policy for draft lengths and clamps them (below); (3) spends the remaining token budget on prefill chunks,
first for requests already running, then for waiting ones by TTFT deadline, within the running requests'
tightest TPOT SLO when the step cost model is known.
`update(plan, result)` commits what the step produced and releases what it no longer needs.

The clamps, applied to whatever the policy asks, in order: at most the configured ceiling and what the
proposer can offer (a prompt-lookup hit's length); no more than the request can still commit minus its
own token (max_tokens, max_model_len); within the step's token budget (decodes in batch order); within
the free KV slots. Drafts never preempt anyone: speculation is optional, a running request's next
token is not.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Iterable

import numpy as np

from specserve.step_types import BatchView, DraftOffer, RequestView, ScheduledSeq, StepPlan, StepResult
from specserve.engine.block_manager import BlockManager, block_hash, salt_hash
from specserve.engine.output_processor import Verdict
from specserve.engine.sequence import Sequence, Status


# A request without a TTFT SLO is admitted as if its deadline were this long after its arrival: among
# themselves such requests go first come, first served; a request with a tighter objective overtakes them.
NO_SLO_TTFT = 60.0


class DeadlineAdmission:
    """Waiting requests by TTFT deadline (arrival + slo_ttft), earliest first (docs/design.md §3.5)."""

    def order(self, waiting: Iterable[Sequence]) -> list[Sequence]:
        return sorted(waiting, key=lambda s: s.arrival_time + (s.params.slo_ttft or NO_SLO_TTFT))


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_drafts: int = 0, admission=None, step_time=None, peek=None):
        """step_time(rows, kv tokens) -> seconds of a target forward (the step cost model), or None where it
        was not profiled: with it, prefill chunks are cut so that a step stays within the running requests'
        tightest TPOT SLO. peek(seq, k) -> DraftOffer: what the proposer would draft with this step (a
        prompt-lookup hit or a model, and the model's catch-up rows), asked before the policy plans so that
        it prices each request by the draft that will really serve it."""
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_drafts = max_drafts  # the ceiling on any draft length (num_speculative_tokens)
        self.admission = admission or DeadlineAdmission()
        self.step_time = step_time
        self.peek = peek
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: preemption takes from the end
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """End a request wherever it is (its output is the caller's to make) and free its blocks."""
        self.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        seq.finished_time = time.monotonic()

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted request and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)

    # ---- schedule --------------------------------------------------------------------------------
    def schedule(self, policy=None) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_decodes(plan)
        if policy is not None and policy.may_draft and plan.decodes:
            budget -= self._schedule_drafts(plan, policy, budget)
        self._schedule_prefills(plan, budget)
        return plan

    def _schedule_decodes(self, plan: StepPlan) -> int:
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq.status != Status.RUNNING or seq.in_prefill or budget < 1:
                continue
            while not self.blocks.can_grow(seq.block_table, seq.num_computed + 1):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status != Status.RUNNING:
                continue
            self.blocks.grow(seq.block_table, seq.num_computed + 1)
            plan.decodes.append(ScheduledSeq(seq, 1))
            scheduled.add(id(seq))
            budget -= 1
        return budget

    def _schedule_drafts(self, plan: StepPlan, policy, budget: int) -> int:
        """Ask the policy, clamp, reserve KV slots. Returns the tokens the drafts take from the budget."""
        plan.view = self.batch_view(plan.decodes, budget)
        wanted = policy.plan(plan.view)
        plan.prediction = getattr(policy, "last_plan", None)  # a model-based policy's predictions, for the stats
        used = 0
        for s, want, most in zip(plan.decodes, wanted, plan.view.limits()):
            seq = s.seq
            n = max(0, min(int(want), most, budget - used))
            room = (len(seq.block_table) + self.blocks.num_free) * self.blocks.block_size - seq.num_computed - 1
            n = max(0, min(n, room))
            if n:
                self.blocks.grow(seq.block_table, seq.num_computed + 1 + n)
            s.max_drafts = n
            used += n
        return used

    def batch_view(self, decodes: list[ScheduledSeq], budget: int) -> BatchView:
        requests = []
        for s in decodes:
            seq = s.seq
            offer = DraftOffer(*self.peek(seq, self.max_drafts)) if self.peek else DraftOffer(None, None)
            requests.append(RequestView(seq.request_id, len(seq.token_ids), self.tokens_left(seq), seq.spec,
                                        offer.draft, seq.params.greedy, seq.params.slo_tpot, offer.most,
                                        offer.first_rows))
        free = self.blocks.num_free * self.blocks.block_size + sum(
            len(s.seq.block_table) * self.blocks.block_size - s.seq.num_computed - 1 for s in decodes)
        prefilling = [s for s in self.running if s.in_prefill]
        pending = 0
        for seq in itertools.chain(prefilling, self.waiting):
            if pending >= budget:
                break
            pending += len(seq.token_ids) - seq.num_computed
        return BatchView(requests, self.max_drafts, budget, free, len(self.waiting), min(pending, budget),
                         len(prefilling))

    def tokens_left(self, seq: Sequence) -> int:
        return min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))

    def _tpot_budget(self, plan: StepPlan, budget: int) -> int:
        """Prefill tokens that keep the step within the tightest TPOT SLO of the decodes (all of the budget
        without SLOs or a cost model). Under overload this protects admitted requests: new ones wait."""
        slos = [s.seq.params.slo_tpot for s in plan.decodes if s.seq.params.slo_tpot]
        if not slos or self.step_time is None:
            return budget
        rows = sum(1 + s.max_drafts for s in plan.decodes)
        kv = sum(len(s.seq.token_ids) + s.max_drafts for s in plan.decodes)
        extra = np.arange(budget + 1)
        seconds = self.step_time(rows + extra, kv + extra)
        if seconds is None:
            return budget
        fits = np.flatnonzero(seconds <= min(slos))
        return int(fits[-1]) if len(fits) else 0

    def _schedule_prefills(self, plan: StepPlan, budget: int) -> None:
        budget = self._tpot_budget(plan, budget)
        candidates = [s for s in self.running if s.in_prefill] + self.admission.order(self.waiting)
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
                    if plan.is_empty:  # nothing else can run: free room, or this loops forever
                        self.preempt(self.running[-1], plan)
                    break
            else:
                self._take_cached_prefix(seq)
                chunk = min(len(seq.token_ids) - seq.num_computed, budget)
                if not self.blocks.can_grow(seq.block_table, seq.num_computed + chunk):
                    self.blocks.free(seq.block_table)
                    seq.num_computed = seq.num_registered = 0
                    break  # new requests wait rather than preempt admitted ones
                plan.cache_queries += len(seq.token_ids) if self.blocks.enable_caching and \
                    seq.params.prompt_logprobs is None else 0
                plan.cache_hits += seq.num_computed
            if waiting:
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.blocks.grow(seq.block_table, seq.num_computed + chunk)
            plan.prefills.append(ScheduledSeq(seq, chunk))
            budget -= chunk

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """An admitted request starts after the longest prefix of its tokens whose KV the prefix cache holds
        (its last token is always computed: its logits are needed)."""
        if self.blocks.enable_caching and seq.params.prompt_logprobs is None:  # those need every prompt row
            seq.block_table = self.blocks.match(self._hashes(seq, len(seq.token_ids)), len(seq.token_ids))
            seq.num_computed = len(seq.block_table) * self.blocks.block_size
            seq.num_registered = len(seq.block_table)

    def _hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """The prefix-cache hashes of the full blocks within the first num_tokens tokens (computed once)."""
        size, hashes = self.blocks.block_size, seq.block_hashes
        for i in range(len(hashes), num_tokens // size):
            hashes.append(block_hash(hashes[-1] if hashes else salt_hash(seq.params.cache_salt),
                                     seq.token_ids[i * size:(i + 1) * size]))
        return hashes

    def _cache_full_blocks(self, seq: Sequence, num_final: int) -> None:
        """Register the blocks whose positions all hold final KV (the first num_final tokens')."""
        full = num_final // self.blocks.block_size
        if self.blocks.enable_caching and full > seq.num_registered:
            hashes = self._hashes(seq, num_final)
            for i in range(seq.num_registered, full):
                self.blocks.register(seq.block_table[i], hashes[i])
            seq.num_registered = full

    def preempt(self, seq: Sequence, plan: StepPlan | None = None) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_registered = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if plan is not None:
            plan.preempted.append(seq)
            plan.prefills = [s for s in plan.prefills if s.seq is not seq]
            plan.decodes = [s for s in plan.decodes if s.seq is not seq]

    # ---- update ----------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult,
               verdicts: list[Verdict]) -> list[tuple[Sequence, list[int], list | None]]:
        """Commit each sampling row's tokens as far as its verdict says (the output processor found where it
        stops), count its draft's acceptance, advance prefill chunks, finish requests, release rejected draft
        slots. Returns (seq, new tokens, their logprobs, their top logprobs) per sampling row."""
        for seq, position, entries in result.prompt_logprobs:
            seq.add_prompt_logprobs(position, entries)
        for s in plan.prefills:
            s.seq.num_computed += s.num_tokens  # a completing chunk is overwritten below
            self._cache_full_blocks(s.seq, s.seq.num_computed)
        now = time.monotonic()
        committed = []
        drafted = result.proposal.lengths + [0] * (len(result.sampling) - len(result.proposal.lengths))
        tops = result.top_logprobs or [None] * len(result.sampling)
        rows = zip(result.sampling, result.committed, result.logprobs, drafted, verdicts, tops)
        for i, (s, tokens, logprobs, length, verdict, top) in enumerate(rows):
            seq = s.seq
            if i < len(plan.decodes):  # sampling rows: the decodes first
                seq.spec.last_drafted = length
            if length:
                seq.spec.record(length, len(tokens) - 1)
            n = verdict.num_tokens
            new = tokens[:n]
            logprobs, top = None if logprobs is None else logprobs[:n], None if top is None else top[:n]
            seq.append(new, logprobs, top)
            if seq.first_token_time is None:
                seq.first_token_time = now
            # KV is final for every committed token but the last (accepted drafts included): shareable
            self._cache_full_blocks(seq, len(seq.token_ids) - 1)
            if verdict.finish_reason is not None:
                seq.status, seq.finished_time = Status.FINISHED, now
                seq.finish_reason, seq.stop_reason = verdict.finish_reason, verdict.stop_reason
                self.remove(seq)
            else:
                seq.num_computed = len(seq.token_ids) - 1
                self.blocks.shrink(seq.block_table, len(seq.token_ids))  # release rejected draft slots
            committed.append((seq, new, logprobs, top))
        return committed
