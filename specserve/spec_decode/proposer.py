"""Proposers: where draft tokens come from. A small model drafting in a batched loop over its own paged KV
cache (`Drafter`), which a standalone draft and an EAGLE draft both use; the model-free proposers (prompt
lookup, suffix decoding) are in lookup.py and suffix.py.

What every proposer offers the engine is the protocol in proposer_protocol.py.
"""
from __future__ import annotations

import torch

from specserve.step_types import DraftOffer, ForwardItem, Proposal, ScheduledSeq
from specserve.model.kernels import argmax_rows
from specserve.sampling_ops import RowParams, draw, draw_at, penalize_draft, process
from specserve.spec_decode.choice import DraftChoice
from specserve.spec_decode.lookup import lookup_proposal
from specserve.structured_output.drafts import DraftGuide


class Drafter:
    """Batched autoregressive drafting with a small model: one forward per draft position for every request
    still drafting, the sampled token fed back on the device. Requests drop out at their planned length, known
    on the host: drafting reads nothing back from the device. With `lookups` (prompt lookup, suffix decoding:
    free), a request takes a lookup's hit where there is one (the better of two, choice.py), and the model
    drafts for the others."""

    def __init__(self, runner, target_vocab_size: int, vocab_map: torch.Tensor | None, name: str,
                 lookups: list | None = None, choice: DraftChoice | None = None):
        self.runner = runner
        self.vocab_size = target_vocab_size
        # [draft_vocab] target id of each draft head row (on the draft's device), or None for a full head
        self.vocab_map = None if vocab_map is None else vocab_map.to(runner.device)
        # The draft rows in the target's token order (None: already in it, as `specserve distill` writes them)
        self.target_order = None
        if vocab_map is not None and not bool((vocab_map[1:] > vocab_map[:-1]).all()):
            self.target_order = torch.argsort(self.vocab_map)
        self.name = name
        self.lookups = lookups or []  # NgramProposer, SuffixProposer: each with a `name` and hit(seq, k)
        self.choice = choice or DraftChoice()
        self.computed: dict[str, int] = {}  # request id -> tokens whose draft KV is in the cache
        self.chosen: dict[str, tuple[int, int, str, list[int]]] = {}  # id -> (length, k, source, its hit)

    def propose(self, decodes: list[ScheduledSeq], confidences: bool, extra_items: list[ForwardItem],
                features=None) -> Proposal:
        """extra_items: rows the draft cache needs that ask no logits (prefill catch-up), run in the first
        forward. features(seq) -> [rows, hidden]: an EAGLE draft's target features for the request's rows."""
        device, n = self.runner.device, len(decodes)
        found, sources = [[] for _ in range(n)], [None] * n
        drafting, items, feats = [], list(extra_items), []
        for i, s in enumerate(decodes):
            if not s.max_drafts:
                continue
            seq = s.seq
            source, hit = self.choose(seq, s.max_drafts)
            if source != self.name:
                found[i], sources[i] = hit[:s.max_drafts], source
                continue
            if features is not None:
                feats.append(features(seq))
            items.append(ForwardItem(seq.token_ids[self.computed.get(seq.request_id, 0):], len(seq.token_ids),
                                     seq.block_table, 1))
            drafting.append(i)
        proposal = lookup_proposal(found, confidences, device)
        proposal.sources = sources
        if confidences:
            self._lookup_confidences(proposal, decodes, found, sources)
        k = max((s.max_drafts for s in decodes), default=0)
        if drafting:
            proposal.host_token_ids = None  # the model's drafts stay on the device
            proposal.token_ids = torch.cat([proposal.token_ids, proposal.token_ids.new_zeros(n, k - proposal.token_ids.shape[1])], 1)
            if proposal.confidences is not None:
                proposal.confidences = torch.cat([proposal.confidences, proposal.confidences.new_ones(
                    n, k - proposal.confidences.shape[1])], 1)
        proposal.sampled = [i for i, s in enumerate(decodes) if s.max_drafts and not s.seq.params.greedy]
        if proposal.sampled:
            proposal.probs = self._one_hot_lookups(found, proposal.sampled, k)
        if drafting and not confidences and self._chain(decodes, drafting, items, feats, proposal):
            return proposal
        step, device_ids = 0, None
        guide = DraftGuide(decodes) if any(decodes[i].seq.grammar is not None for i in drafting) else None
        while items:
            logits, predicted = self.runner.forward(items, torch.cat(feats) if feats else None, device_ids=device_ids)
            proposal.draft_forwards.append((self.name, sum(it.num_tokens for it in items),
                                            sum(it.ctx_len for it in items)))
            if not drafting:  # only prefill catch-up rows
                break
            if guide is not None and (bias := guide.bias(drafting, proposal.token_ids, step, self.vocab_size,
                                                          self.vocab_map)) is not None:
                logits = logits.index_add(0, *bias)  # structured output: drafts within the grammar
            logits = self._penalized(logits, drafting, decodes, proposal.token_ids, step)
            tokens = self._draft_one(logits, drafting, decodes, proposal, step)
            step += 1
            for i in drafting:
                self.computed[decodes[i].seq.request_id] = len(decodes[i].seq.token_ids) + step - 1
                proposal.lengths[i] = step
                proposal.sources[i] = self.name
            keep = [r for r, i in enumerate(drafting) if step < decodes[i].max_drafts]
            drafting = [drafting[r] for r in keep]
            # An EAGLE draft's next row reads its own prediction of the target's hidden state.
            feats = [predicted[keep]] if features is not None and keep else []
            device_ids = tokens[torch.tensor(keep, dtype=torch.long, device=device)] if keep else None
            items = [ForwardItem([], len(decodes[i].seq.token_ids) + step, decodes[i].seq.block_table, 1, 1)
                     for i in drafting]
        if guide is not None:
            guide.finish()
        return proposal

    def _chain(self, decodes: list[ScheduledSeq], drafting: list[int], items: list[ForwardItem], feats: list,
               proposal: Proposal) -> bool:
        """Every draft step in one native call (model/cpu_draft.py) where the drafting requests are greedy with
        nothing to shape their drafts (no grammar, no penalties): the same tokens as the step-by-step loop.
        Fills the proposal; False where the chain cannot run (the loop then drafts)."""
        if any(decodes[i].seq.params.penalized or decodes[i].seq.grammar is not None or not decodes[i].seq.params.greedy
               for i in drafting):
            return False
        extra = len(items) - len(drafting)  # a standalone draft's prefill catch-up rows come first
        steps = [0] * extra + [decodes[i].max_drafts for i in drafting]
        out = self.runner.draft_chain(items, torch.cat(feats) if feats else None, steps, self.vocab_map)
        if out is None:
            return False
        proposal.token_ids[torch.tensor(drafting, dtype=torch.long), :out.shape[1]] = out[extra:].clamp_min(0).to(
            proposal.token_ids.device)
        proposal.draft_forwards.append((self.name, sum(it.num_tokens for it in items), sum(it.ctx_len for it in items)))
        for step in range(1, out.shape[1]):
            going = [i for i in drafting if decodes[i].max_drafts > step]
            if going:
                proposal.draft_forwards.append((self.name, len(going),
                                                sum(len(decodes[i].seq.token_ids) + step for i in going)))
        for i in drafting:
            seq, n = decodes[i].seq, decodes[i].max_drafts
            self.computed[seq.request_id] = len(seq.token_ids) + n - 1
            proposal.lengths[i], proposal.sources[i] = n, self.name
        return True

    def peek(self, seq, k: int) -> DraftOffer:
        """Before planning: the source `choose` picks, so the policy prices a lookup hit as free and the model
        as its forwards, the first of which also runs the positions its cache has not seen (after steps
        without drafting: catch-up, priced by the policy)."""
        source, hit = self.choose(seq, k)
        if source != self.name:
            return DraftOffer(source, len(hit), 0)
        return DraftOffer(self.name, k, self._first_rows(seq))

    def choose(self, seq, k: int) -> tuple[str, list[int]]:
        """(source, its draft) for the request this step: a lookup's hit (at most k tokens) or the model (its
        name, no tokens yet), decided once per step (peek, then propose with k no larger)."""
        memo = self.chosen.get(seq.request_id)
        if memo is None or memo[0] != len(seq.token_ids) or memo[1] < k:
            offers = [(p.name, len(p.hit(seq, k))) for p in self.lookups] + [(self.name, k)]
            pick = self.choice.pick(seq.request_id, offers)
            hit = self.lookups[pick].hit(seq, k) if pick < len(self.lookups) else []
            memo = self.chosen[seq.request_id] = (len(seq.token_ids), k, offers[pick][0], hit)
        return memo[2], memo[3]

    def _first_rows(self, seq) -> int:
        return len(seq.token_ids) - self.computed.get(seq.request_id, 0)

    def _lookup_confidences(self, proposal: Proposal, decodes, found, sources) -> None:
        """The suffix drafts' own confidences (the running share of the matches they follow); 1 elsewhere."""
        for i, (hit, source) in enumerate(zip(found, sources)):
            proposer = next((p for p in self.lookups if p.name == source), None)
            if hit and hasattr(proposer, "confidences"):
                proposal.confidences[i, :len(hit)] = torch.tensor(proposer.confidences(decodes[i].seq, len(hit)))

    def forget_outputs(self) -> None:
        for lookup in self.lookups:
            lookup.forget_outputs()

    def reset(self, request_id: str) -> None:
        self.computed.pop(request_id, None)

    def free(self, request_id: str) -> None:
        self.reset(request_id)
        self.chosen.pop(request_id, None)
        for lookup in self.lookups:
            lookup.free(request_id)

    def _penalized(self, logits: torch.Tensor, drafting: list[int], decodes: list[ScheduledSeq],
                   drafts: torch.Tensor, step: int) -> torch.Tensor:
        """The draft logits [len(drafting), Vd] with each penalised request's row penalised as its verify row
        will be (the drafts before it count as output); the same tensor when none asks for a penalty."""
        wanted = [r for r, i in enumerate(drafting) if decodes[i].seq.params.penalized]
        if not wanted:
            return logits
        logits = logits.clone()
        for r in wanted:
            seq = decodes[drafting[r]].seq
            logits[r:r + 1] = penalize_draft(logits[r:r + 1], seq.params, seq.token_ids[:seq.num_prompt_tokens],
                                             seq.output_token_ids, drafts[drafting[r], :step], self.vocab_size,
                                             self.vocab_map)
        return logits

    def _one_hot_lookups(self, found: list[list[int]], sampled: list[int], k: int) -> torch.Tensor:
        """[S, K, V] q rows for the sampled requests: one-hot at each looked-up token, the rest filled by drafting."""
        probs = torch.zeros(len(sampled), k, self.vocab_size, device=self.runner.device)
        cells = [(r, j, t) for r, i in enumerate(sampled) for j, t in enumerate(found[i])]
        if cells:
            probs[tuple(torch.tensor(c, dtype=torch.long, device=probs.device) for c in zip(*cells))] = 1.0
        return probs

    def _draw(self, q: torch.Tensor, seqs: list, step: int) -> torch.Tensor:
        """Draft-vocabulary ids drawn from q [S, Vd]. A seeded request draws with the uniform of the output
        position the token drafts for, in the target's token order, as the sampler will draw from p there:
        the closer q is to p, the more often the two draws are the same token (design.md §4.3)."""
        seeded = [r for r, seq in enumerate(seqs) if seq.params.seed is not None]
        if not seeded:
            return draw(q, [seq.generator for seq in seqs])
        out = torch.empty(len(seqs), dtype=torch.long, device=q.device)
        if unseeded := [r for r, seq in enumerate(seqs) if seq.params.seed is None]:
            rows = torch.tensor(unseeded, dtype=torch.long, device=q.device)
            out[rows] = draw(q[rows], [seqs[r].generator for r in unseeded])
        rows = torch.tensor(seeded, dtype=torch.long, device=q.device)
        qs = q[rows] if self.target_order is None else q[rows][:, self.target_order]
        drawn = draw_at(qs, [seqs[r].params.seed for r in seeded],
                        [seqs[r].num_output_tokens + step for r in seeded])
        out[rows] = drawn if self.target_order is None else self.target_order[drawn]
        return out

    def _draft_one(self, logits: torch.Tensor, drafting: list[int], decodes: list[ScheduledSeq],
                   proposal: Proposal, step: int) -> torch.Tensor:
        """Pick the next draft token of every drafting request from its draft logits [len(drafting), Vd];
        writes tokens (target ids), q rows and confidences into the proposal, returns the tokens [len(drafting)]."""
        device = logits.device
        local = argmax_rows(logits)  # greedy requests; sampled ones are overwritten below
        seqs = [decodes[i].seq for i in drafting]
        sampled = [r for r, seq in enumerate(seqs) if not seq.params.greedy]
        q = None
        if sampled:
            at = torch.tensor(sampled, dtype=torch.long, device=device)
            q = process(logits[at], RowParams.build([seqs[r].params for r in sampled], logits.shape[-1], device))
            local = local.clone()
            local[at] = self._draw(q, [seqs[r] for r in sampled], step)
        tokens = local if self.vocab_map is None else self.vocab_map[local]
        rows = torch.tensor(drafting, dtype=torch.long, device=device)
        proposal.token_ids[rows, step] = tokens
        if proposal.confidences is not None:
            confidence = torch.softmax(logits, dim=-1).gather(1, local[:, None])[:, 0]
            if sampled:
                confidence[at] = q.gather(1, local[at][:, None])[:, 0]
            proposal.confidences[rows, step] = confidence
        if sampled:
            where = {decode: r for r, decode in enumerate(proposal.sampled)}
            full = q if self.vocab_map is None else q.new_zeros(len(sampled), self.vocab_size).index_copy_(1, self.vocab_map, q)
            probs_rows = torch.tensor([where[drafting[r]] for r in sampled], dtype=torch.long, device=device)
            proposal.probs[probs_rows, step] = full
        return tokens


class DraftModelProposer:
    """A standalone draft with the target's tokenizer. Its KV cache has its own tensors but the target's block
    tables, so no separate allocation bookkeeping. Draft prefill rides in the first draft forward."""

    has_cache = True
    reads_target_hidden = False

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.runner = drafter.runner
        self.peek, self.reset, self.free, self.forget_outputs = (drafter.peek, drafter.reset, drafter.free,
                                                                 drafter.forget_outputs)

    def propose(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq], confidences=False) -> Proposal:
        return self.drafter.propose(decodes, confidences, self._catch_up(prefills))

    def _catch_up(self, prefills: list[ScheduledSeq]) -> list[ForwardItem]:
        """Draft-cache rows for the prompt chunks the target computes in this step (no logits wanted)."""
        items, computed = [], self.drafter.computed
        for s in prefills:
            seq, end = s.seq, s.seq.num_computed + s.num_tokens
            done = computed.get(seq.request_id, 0)
            if end > done:
                items.append(ForwardItem(seq.token_ids[done:end], end, seq.block_table, 0))
                computed[seq.request_id] = end
        return items

    def on_commit(self, seq, num_committed: int) -> None:
        # The draft cache holds the fed tokens; only those that were committed stay valid.
        computed = self.drafter.computed
        computed[seq.request_id] = min(computed.get(seq.request_id, 0), len(seq.token_ids) - 1)

