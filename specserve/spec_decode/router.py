"""Several drafts in one engine: each request is drafted by the one whose vocabulary fits its prompt best.

A reduced-vocabulary draft keeps the tokens most frequent in its training corpus (`specserve distill
--draft-vocab`), so the share of a prompt's tokens it keeps says how close the prompt is to what the
draft learned: on average the shipped code draft keeps 98 % of a held-out Python prefix's tokens and 75 %
of a Spec-Bench question's, the chat draft 84 % and 90 % (bench/draft_acceptance.py). No classifier:
one lookup per prompt token, once per request. The choice is kept for the request's lifetime, because a
draft's cache rows (and an EAGLE draft's buffered target features) belong to the draft that made them.

Each draft proposes for its own requests, so a step whose batch mixes them runs one draft forward per
draft and step of drafting; the verification is shared, and each draft's q rows are its own.
"""
from __future__ import annotations

import torch

from specserve.step_types import DraftOffer, Proposal
from specserve.errors import SpecServeError
from specserve.spec_decode.proposer_protocol import Proposer


class RoutedProposer:
    def __init__(self, proposers: list[Proposer], vocab_maps: list[torch.Tensor | None], vocab_size: int,
                 names: list[str]):
        kinds = {(p.has_cache, p.reads_target_hidden) for p in proposers}
        if len(kinds) != 1:
            raise SpecServeError("drafts to route between must be of one kind: all EAGLE or all standalone")
        if any(m is None for m in vocab_maps):
            raise SpecServeError("routing between drafts needs reduced-vocabulary drafts (`specserve distill "
                                 "--draft-vocab`): their kept vocabularies are what picks the draft")
        self.proposers = proposers
        self.names = names  # shown per request (the response's "speculative" stats) and in the metrics
        self.routes: dict[str, int] = {}  # request id -> the draft serving it
        self.has_cache, self.reads_target_hidden = kinds.pop()
        self.kept = torch.zeros(len(proposers), vocab_size, dtype=torch.bool)  # [drafts, vocab]
        for i, vocab_map in enumerate(vocab_maps):
            self.kept[i, vocab_map] = True

    def coverage(self, prompt: list[int]) -> list[float]:
        """The share of the prompt's tokens each draft keeps."""
        return self.kept[:, torch.tensor(prompt, dtype=torch.long)].float().mean(dim=1).tolist()

    def choose(self, prompt: list[int]) -> int:
        """The draft keeping the largest share of the prompt's tokens (ties: the first listed)."""
        coverage = self.coverage(prompt)
        return coverage.index(max(coverage))

    def route(self, seq) -> int:
        """The draft serving this request, chosen from its prompt when first asked."""
        if seq.request_id not in self.routes:
            self.routes[seq.request_id] = self.choose(seq.token_ids[:seq.num_prompt_tokens])
        return self.routes[seq.request_id]

    def draft_of(self, request_id: str) -> str | None:
        """The name of the draft serving the request (None before it was routed)."""
        index = self.routes.get(request_id)
        return None if index is None else self.names[index]

    def peek(self, seq, k: int) -> DraftOffer:
        return self.proposers[self.route(seq)].peek(seq, k)

    def propose(self, prefills, decodes, confidences=False) -> Proposal:
        n = len(decodes)
        k = max((s.max_drafts for s in decodes), default=0)
        device = self.proposers[0].runner.device
        merged = Proposal.empty(n, device)
        merged.token_ids = merged.token_ids.new_zeros(n, k)
        parts = []
        routes = [self.route(s.seq) for s in decodes]
        prefill_routes = [self.route(s.seq) for s in prefills]
        for index, proposer in enumerate(self.proposers):
            mine = [i for i, r in enumerate(routes) if r == index]
            own_prefills = [s for s, r in zip(prefills, prefill_routes) if r == index]
            if not any(decodes[i].max_drafts for i in mine) and not (own_prefills and self.has_cache):
                continue
            part = proposer.propose(own_prefills, [decodes[i] for i in mine], confidences)
            parts.append((mine, part))
            rows = torch.tensor(mine, dtype=torch.long, device=device)
            merged.token_ids[rows, :part.token_ids.shape[1]] = part.token_ids
            for row, i in enumerate(mine):
                merged.lengths[i], merged.sources[i] = part.lengths[row], part.sources[row]
            if part.host_token_ids is None:  # some drafts only on the device: the merged ones too
                merged.host_token_ids = None
            elif merged.host_token_ids is not None:
                for row, i in enumerate(mine):
                    merged.host_token_ids[i] = part.host_token_ids[row]
            if part.confidences is not None:
                if merged.confidences is None:
                    merged.confidences = torch.ones(n, k, device=device)
                merged.confidences[rows, :part.confidences.shape[1]] = part.confidences
            merged.sampled += [mine[r] for r in part.sampled]
            merged.draft_forwards += part.draft_forwards
        if any(part.probs is not None for _, part in parts):  # q rows of the sampled requests, in merged order
            vocab = next(part.probs.shape[-1] for _, part in parts if part.probs is not None)
            merged.probs = torch.zeros(len(merged.sampled), k, vocab, device=device)
            at = 0
            for mine, part in parts:
                if part.probs is not None:
                    merged.probs[at:at + len(part.sampled), :part.probs.shape[1]] = part.probs
                at += len(part.sampled)
        return merged

    def observe_target(self, entries, hidden: torch.Tensor) -> None:
        mine: dict[int, list] = {}
        for entry in entries:
            mine.setdefault(self.route(entry.seq), []).append(entry)
        for index, part in mine.items():
            self.proposers[index].observe_target(part, hidden)

    def on_commit(self, seq, num_committed: int) -> None:
        self.proposers[self.route(seq)].on_commit(seq, num_committed)

    def forget_outputs(self) -> None:
        for proposer in self.proposers:
            proposer.forget_outputs()

    def reset(self, request_id: str) -> None:
        """Preempted: the draft's cache rows are gone, the choice of draft stays (it is the prompt's)."""
        if request_id in self.routes:
            self.proposers[self.routes[request_id]].reset(request_id)

    def free(self, request_id: str) -> None:
        if (index := self.routes.pop(request_id, None)) is not None:
            self.proposers[index].free(request_id)
