"""Proposers: where draft tokens come from. A draft model (batched, own paged KV cache) or n-gram lookup."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.engine.model_runner import ForwardItem, ModelRunner
from specserve.engine.sampler import sample, to_probs
from specserve.engine.scheduler import ScheduledSeq


@dataclass(slots=True)
class Proposal:
    token_ids: list[list[int]]         # drafts per decode (l_i tokens)
    probs: torch.Tensor | None         # [N, K, V] full-vocabulary q; None for deterministic proposals
    confidences: list[list[float]]     # draft probability of each drafted token (1.0 for n-gram)
    seconds: float = 0.0


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens (n from max
    down to min) and propose the tokens that followed it."""

    has_cache = False
    reads_target_hidden = False

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], controller) -> Proposal:
        t0 = time.perf_counter()
        drafts = [self.lookup(s.seq.token_ids, s.max_drafts) if s.max_drafts else [] for s in decodes]
        keep = controller.final_lengths([[1.0] * len(d) for d in drafts])
        drafts = [d[:n] for d, n in zip(drafts, keep)]
        return Proposal(drafts, None, [[1.0] * len(d) for d in drafts], time.perf_counter() - t0)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        arr = np.asarray(tokens)
        for n in range(min(self.max_n, len(arr) - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return arr[start:start + k].tolist()
        return []

    def on_commit(self, seq, num_committed: int) -> None:
        pass


class DraftModelProposer:
    """A small model with the target's tokenizer. Its KV cache has its own tensors but the target's block
    tables, so no separate allocation bookkeeping. Draft prefill rides in the first draft forward.

    With `lookup` (n-gram prompt lookup), a request whose context repeats takes the lookup's tokens
    (free, and on code they are accepted more often than the draft model's) and the draft model drafts
    only for the others; the draft cache catches up with the skipped tokens in its next forward."""

    has_cache = True
    reads_target_hidden = False

    def __init__(self, runner: ModelRunner, target_vocab_size: int, vocab_map: torch.Tensor | None,
                 lookup: NgramProposer | None = None):
        self.runner = runner
        self.vocab_size = target_vocab_size
        # [draft_vocab] target id of each draft head row (on the draft's device, where q is scattered), or None
        self.vocab_map = None if vocab_map is None else vocab_map.to(runner.device)
        self.target_ids = None if vocab_map is None else vocab_map.tolist()
        self.lookup = lookup

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], controller) -> Proposal:
        t0 = time.perf_counter()
        items = self._catch_up(prefills)
        features, drafting = [], []
        n = len(decodes)
        tokens: list[list[int]] = [[] for _ in range(n)]
        conf: list[list[float]] = [[] for _ in range(n)]
        for i, s in enumerate(decodes):
            if not s.max_drafts:
                continue
            seq = s.seq
            if self.lookup is not None and (found := self.lookup.lookup(seq.token_ids, s.max_drafts)):
                tokens[i], conf[i] = found, [1.0] * len(found)
                continue
            if self.reads_target_hidden:
                features.append(self._pending_features(seq))
            items.append(ForwardItem(seq.token_ids[seq.num_draft_computed:], len(seq.token_ids),
                                     seq.block_table, 1))
            drafting.append(i)
        sampled = [i for i, s in enumerate(decodes) if s.max_drafts and not s.seq.params.greedy]
        kmax = max((s.max_drafts for s in decodes), default=0)
        probs = torch.zeros(n, kmax, self.vocab_size, device=self.runner.device) if sampled else None
        for i in sampled:  # looked-up tokens are deterministic proposals: q is one-hot at each
            for j, token in enumerate(tokens[i]):
                probs[i, j, token] = 1.0
        step = 0
        while items:
            # One row per drafting request (prefill catch-up asks none); `predicted`: the draft's hidden state.
            logits, predicted = self.runner.forward(items, torch.cat(features) if features else None)
            self._draft_one(logits, drafting, decodes, tokens, conf, probs, step)
            step += 1
            for i in drafting:
                decodes[i].seq.num_draft_computed = len(decodes[i].seq.token_ids) + step - 1
            go = controller.keep_drafting(step, [conf[i] for i in drafting])
            keep = [r for r, (i, g) in enumerate(zip(drafting, go)) if g and step < decodes[i].max_drafts]
            drafting = [drafting[r] for r in keep]
            # An EAGLE draft's next row reads its own prediction of the target's hidden state.
            features = [predicted[keep]] if self.reads_target_hidden and keep else []
            items = [ForwardItem([tokens[i][-1]], len(decodes[i].seq.token_ids) + step,
                                 decodes[i].seq.block_table, 1) for i in drafting]
        keep = controller.final_lengths(conf)
        tokens = [t[:k] for t, k in zip(tokens, keep)]
        conf = [c[:k] for c, k in zip(conf, keep)]
        return Proposal(tokens, probs, conf, time.perf_counter() - t0)

    def _catch_up(self, prefills: list[ScheduledSeq]) -> list[ForwardItem]:
        """Draft-cache rows for the prompt chunks the target computes in this step (no logits wanted)."""
        items = []
        for s in prefills:
            seq, end = s.seq, s.seq.num_computed + s.num_tokens
            if end > seq.num_draft_computed:
                items.append(ForwardItem(seq.token_ids[seq.num_draft_computed:end], end, seq.block_table, 0))
                seq.num_draft_computed = end
        return items

    def _draft_one(self, logits, drafting, decodes, tokens, conf, probs, step) -> None:
        """Pick the next draft token of every drafting request from its draft logits [len(drafting), Vd]."""
        raw = torch.softmax(logits, dim=-1)
        for row, i in enumerate(drafting):
            params = decodes[i].seq.params
            if params.greedy:
                local = int(raw[row].argmax())
                conf[i].append(float(raw[row, local]))
            else:
                q = to_probs(logits[row:row + 1], [params])[0]
                local = sample(q[None], [decodes[i].seq.generator])[0]
                conf[i].append(float(q[local]))
                if self.vocab_map is None:
                    probs[i, step] = q
                else:
                    probs[i, step].index_copy_(0, self.vocab_map, q)
            tokens[i].append(local if self.target_ids is None else self.target_ids[local])

    def on_commit(self, seq, num_committed: int) -> None:
        # The draft cache holds the fed tokens; only those that were committed stay valid.
        seq.num_draft_computed = min(seq.num_draft_computed, len(seq.token_ids) - 1)
