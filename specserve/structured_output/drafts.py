"""The proposers' side of a step: drafts kept within their requests' grammars. Before the verify forward, each
guided request's drafts are cut at the first token its grammar forbids (the target, masked, would reject it
anyway, and a cut draft's verify rows are not paid for); a draft model drafts under the grammar's mask
(DraftGuide), so that its drafts survive the cut (docs/design.md §4.4)."""
from __future__ import annotations

from collections.abc import Collection

import torch

from specserve.device_sync import to_host
from specserve.structured_output.masks import mask_bias, words


def kept_drafts(valid: int, length: int, stochastic: bool) -> int:
    """How many of a request's `length` drafts go to the verify when its grammar allows the first `valid`.
    Those; and after them, for a draft drawn from a distribution q (a draft model's, sampled), the first
    forbidden one too: the target (p = 0 there) rejects it and draws the recovered token from
    normalize(max(0, p − q)), which is what keeps the output p's. Dropping it and drawing from p would
    not: P(y) would be min(p, q) + (q(M) − β)/(1 − β)·max(0, p − q) + q(not M)·p (M: what the grammar
    allows, β: the acceptance probability), not p (docs/design.md §4.4). A deterministic draft (greedy, or
    prompt lookup's one-hot q) is dropped: its residual is p itself."""
    return min(length, valid + 1) if stochastic and valid < length else valid


def cut_drafts(decodes, proposal, lookups: Collection[str]) -> dict[int, list[int]]:
    """Cuts each guided decode's drafts after the first token its grammar forbids (kept_drafts; proposal.lengths
    in place); returns the grammar-valid drafts of each guided decode, by index. One host read of the drafts
    when any is guided. `lookups`: the proposers whose drafts are looked up, not drawn (their q is one-hot)."""
    guided = [i for i, s in enumerate(decodes) if s.seq.grammar is not None]
    if not guided:
        return {}
    # (one more host read in a step where a guided request drafted: its drafts must be known before the verify)
    rows = to_host(proposal.token_ids[guided])[0] if any(proposal.lengths[i] for i in guided) else None
    kept = {}
    for r, i in enumerate(guided):
        drafts = rows[r][:proposal.lengths[i]] if rows else []
        n = decodes[i].seq.grammar.valid_prefix(drafts) if drafts else 0
        stochastic = proposal.probs is not None and i in proposal.sampled and proposal.sources[i] not in lookups
        proposal.lengths[i] = kept_drafts(n, len(drafts), stochastic)
        kept[i] = drafts[:n]
    return kept


class DraftGuide:
    """Keeps a draft model's proposals for guided requests within their grammars: at each draft step, the
    drafting rows of guided requests get the grammar's bias after the drafts so far (read back from the
    device: one host read per draft step when any drafting request is guided). Without it, a draft that
    proposes what the grammar forbids is cut before the verify, after its forward was paid for. The drafts'
    q is then the masked draft distribution, which rejection sampling takes like any other q."""

    def __init__(self, decodes):
        self.grammars = {i: s.seq.grammar for i, s in enumerate(decodes) if s.seq.grammar is not None}
        self.advanced = dict.fromkeys(self.grammars, 0)

    def bias(self, drafting: list[int], token_ids: torch.Tensor, step: int, vocab_size: int,
             vocab_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of `drafting` to bias, their bias [R, draft vocabulary]) for draft step `step`, or None."""
        rows = [r for r, i in enumerate(drafting) if i in self.grammars]
        if not rows:
            return None
        if step:  # the previous step's drafts, now known: advance each grammar by its own
            previous = to_host(token_ids[[drafting[r] for r in rows], step - 1])[0]
            for r, token in zip(rows, previous):
                i = drafting[r]
                if self.advanced[i] == step - 1 and self.grammars[i].valid_prefix([token]) == 1:
                    self.advanced[i] += self.grammars[i].advance([token])
            rows = [r for r in rows if self.advanced[drafting[r]] == step]  # (a forbidden draft is cut later)
            if not rows:
                return None
        mask = torch.empty(len(rows), words(vocab_size), dtype=torch.int32)
        for m, r in zip(mask, rows):
            self.grammars[drafting[r]].fill(m)
        bias = mask_bias(mask, vocab_size).to(token_ids.device)
        if vocab_map is not None:  # a reduced-vocabulary draft: its head rows' target tokens
            bias = bias[:, vocab_map]
        return torch.tensor(rows, dtype=torch.long, device=token_ids.device), bias

    def finish(self) -> None:
        """Back to the committed output's state."""
        for i, n in self.advanced.items():
            if n:
                self.grammars[i].rollback(n)
