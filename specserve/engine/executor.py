"""Runs a step's plan: draft, one target forward over prefill chunks, decodes and (k+1)-token verifies
together, then sample/verify with the step's one device->host read. Changes no request state: the output
processor and the scheduler commit the result (the proposer's own tables are its own)."""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from specserve.step_types import ForwardItem, PhaseTimes, Proposal, StepPlan, StepResult
from specserve.engine.model_runner import ModelRunner
from specserve.engine.sampler import Sampler, prompt_logprobs
from specserve.engine.sequence import Sequence
from specserve.spec_decode.config import FREE
from specserve.structured_output.drafts import cut_drafts
from specserve.structured_output.masks import apply_logit_bias, logit_bias

# A hidden-state tap receives, after each step, the target's final hidden state of every position that stays
# committed. EAGLE drafts read them; `specserve distill` records them as training features.
class TapEntry(NamedTuple):
    """One request's positions in a step's hidden rows: positions first .. first + count - 1 are hidden rows
    row .. row + count - 1."""
    seq: Sequence
    first: int
    row: int
    count: int


HiddenTap = Callable[[list[TapEntry], torch.Tensor], None]  # (entries, hidden [T, hidden]) after each step


class DeviceClock:
    """Phase times on the device's own timeline (CUDA events). On a GPU the host returns from a forward as soon
    as its work is queued, so host clocks would credit the forward's time to whatever waits next (the
    sampler's transfer) and the cost model would learn that forwards are free. On the CPU: no events."""

    MARKS = 3  # a step's: start, drafted, forwarded

    def __init__(self, device: torch.device):
        # Created once and recorded again each step (a new event per mark cost host time on every step).
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(self.MARKS)] \
            if device.type == "cuda" else None
        self.count = 0

    def start(self) -> None:
        self.count = 0

    def mark(self) -> None:
        if self.events is not None:
            self.events[self.count].record()
            self.count += 1

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks (after the step's transfer, the wait is none)."""
        marks = self.events[:self.count]
        marks[-1].synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]


class Executor:
    def __init__(self, runner: ModelRunner, proposer=None, policy=None, sampler: Sampler | None = None):
        self.runner = runner
        self.proposer = proposer
        self.policy = policy
        self.sampler = sampler or Sampler()
        self.clock = DeviceClock(runner.device)
        self.hidden_taps: list[HiddenTap] = []
        if proposer is not None and proposer.reads_target_hidden:
            self.hidden_taps.append(proposer.observe_target)

    def execute(self, plan: StepPlan) -> StepResult:
        times = PhaseTimes()
        clock = self.clock
        clock.start()
        t0 = time.perf_counter()
        clock.mark()
        proposal = self.propose(plan)
        t_cut = time.perf_counter()
        kept = cut_drafts(plan.decodes, proposal, FREE)  # structured output: drafts its grammar forbids go now
        t1 = time.perf_counter()
        clock.mark()
        items, owners, sampling, draft_ids, prompt_rows = self._forward_items(plan, proposal)
        logits, hidden = self.runner.forward(items, all_hidden=bool(self.hidden_taps), device_ids=draft_ids)
        t2 = time.perf_counter()
        clock.mark()
        prompt = []
        if prompt_rows:  # requests that asked for prompt logprobs had every prompt row's logits computed
            prompt = prompt_logprobs(logits, items, prompt_rows)
            logits = logits[_sampled_rows(items, prompt_rows, logits.device)]
        bias = logit_bias(sampling, kept, proposal.lengths, logits.shape[-1], logits.device)
        allowed = apply_logit_bias(logits, bias)  # structured output: what the grammar forbids at FORBIDDEN
        times.grammar = (t1 - t_cut) + (time.perf_counter() - t2)
        committed, logprobs, confidences, top_logprobs = self.sampler(allowed, sampling, proposal, raw=logits)
        if self.hidden_taps:
            self._tap(items, owners, committed[:len(plan.decodes)], hidden)
        times.draft, times.forward, times.sample = t1 - t0, t2 - t1, time.perf_counter() - t2
        if clock.events is not None:  # the sampler's transfer waited for the device: its phases are now known
            device_draft, device_forward = clock.intervals()
            times.draft, times.forward = device_draft, device_forward
            times.sample = max(0.0, time.perf_counter() - t0 - device_draft - device_forward)
        return StepResult(sampling, committed, logprobs, proposal, times, sum(it.ctx_len for it in items),
                          confidences, top_logprobs, prompt)

    def propose(self, plan: StepPlan) -> Proposal:
        """Drafts for the plan's decodes, each exactly as long as planned (or its lookup hit)."""
        decodes, device = plan.decodes, self.runner.device
        wants = any(s.max_drafts for s in decodes)
        if self.proposer is None or not (wants or (plan.prefills and self.proposer.has_cache)):
            return Proposal.empty(len(decodes), device)
        return self.proposer.propose(plan.prefills, decodes, self.policy.wants_confidences)

    def _forward_items(self, plan: StepPlan, proposal: Proposal):
        """The target's rows: each decode's last token + its drafts (on the device), then prefill chunks.
        Returns (items, each item's sequence, the requests that sample, the drafts flattened in item order, and
        the prompt-logprob rows: (seq, position of the first token they predict, item index, first row within
        the item's logits, rows))."""
        items, sampling, cells, prompt_rows = [], [], [], []
        host = proposal.host_token_ids
        for i, (s, length) in enumerate(zip(plan.decodes, proposal.lengths)):
            seq = s.seq
            if host is not None:  # drafts known on the host travel with the step's other tokens
                items.append(ForwardItem(seq.token_ids[seq.num_computed:] + host[i][:length],
                                         len(seq.token_ids) + length, seq.block_table, 1 + length))
            else:
                items.append(ForwardItem(seq.token_ids[seq.num_computed:], len(seq.token_ids) + length,
                                         seq.block_table, 1 + length, length))
                cells += [(i, j) for j in range(length)]
            sampling.append(s)
        for s in plan.prefills:
            seq, end = s.seq, s.seq.num_computed + s.num_tokens
            completes = end == len(seq.token_ids)
            # Row r of the chunk predicts position start + r + 1: those of prompt positions not yet scored
            first = max(seq.num_computed + 1, len(seq.prompt_logprobs))
            scored = min(end + 1, seq.num_prompt_tokens) - first
            wants = seq.params.prompt_logprobs is not None and scored > 0
            num_logits = end - seq.num_computed if wants else int(completes)
            if wants:
                prompt_rows.append((seq, first, len(items), first - seq.num_computed - 1, scored))
            items.append(ForwardItem(seq.token_ids[seq.num_computed:end], end, seq.block_table, num_logits))
            if completes:
                sampling.append(s)
        draft_ids = None
        if cells:
            index = [torch.tensor(c, dtype=torch.long, device=self.runner.device) for c in zip(*cells)]
            draft_ids = proposal.token_ids[index[0], index[1]]
        owners = [s.seq for s in plan.decodes] + [s.seq for s in plan.prefills]
        return items, owners, sampling, draft_ids, prompt_rows

    def _tap(self, items, owners, decoded, hidden) -> None:
        """Hands each tap, in one call, the hidden rows of positions that stay: a decode's last token and
        accepted drafts (`decoded`: the decodes' committed tokens; decodes come first), every token of a
        prefill chunk. One call per step, not per request: a write per request cost ~30 us each."""
        entries, start = [], 0
        for j, (item, seq) in enumerate(zip(items, owners)):
            valid = len(decoded[j]) if j < len(decoded) else item.num_tokens
            entries.append(TapEntry(seq, item.ctx_len - item.num_tokens, start, valid))
            start += item.num_tokens
        for tap in self.hidden_taps:
            tap(entries, hidden)


def _sampled_rows(items: list[ForwardItem], prompt_rows, device) -> torch.Tensor:
    """The logits rows the sampler reads when some prefill items computed every row for prompt logprobs:
    each other item's rows; of a prompt-logprob item only its last, and only if it completes its prompt (it
    then samples the first output token)."""
    scoring = {index: seq for seq, _, index, _, _ in prompt_rows}
    rows, start = [], 0
    for i, it in enumerate(items):
        if i not in scoring:
            rows += range(start, start + it.num_logits)
        elif it.ctx_len == len(scoring[i].token_ids):
            rows.append(start + it.num_logits - 1)
        start += it.num_logits
    return torch.tensor(rows, dtype=torch.long, device=device)
