"""The step's sampler: turns the target's logits of every sampling row into committed tokens.

Plain decoding is verification with zero drafts, so one path serves decodes, (k+1)-token verifies and the
first token after a prefill, greedy and sampled alike. Rows arrive flattened ([T, V], request i owning
l_i + 1 consecutive rows); greedy and sampled requests each take one vectorized call of the rejection
sampler, and the step's results (tokens, logprobs, draft confidences) cross to the host in one transfer.
A step whose requests are all greedy without logprobs moves the argmax rows and drafts instead and accepts
on the host (`_greedy`: the same tokens; a few list comparisons cost less than launching tensor ops).
"""
from __future__ import annotations

import torch

from specserve.step_types import Proposal, ScheduledSeq
from specserve.device_sync import to_host
from specserve.model.kernels import argmax_rows
from specserve.sampling_ops import RowParams, draw_at, penalize, process, to_probs  # noqa: F401  (to_probs: the API)
from specserve.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample
from specserve.spec_decode.synthetic import SyntheticAcceptance


class Sampler:
    def __init__(self, synthetic: SyntheticAcceptance | None = None):
        self.synthetic = synthetic  # benchmarks only: drafts kept at set rates, not verified

    def __call__(self, logits: torch.Tensor, sampling: list[ScheduledSeq], proposal: Proposal,
                 raw: torch.Tensor | None = None
                 ) -> tuple[list[list[int]], list[list[float] | None], list[list[float]] | None, list | None]:
        """logits [T, V] float32 of the sampling rows; `sampling`: decodes (proposal.lengths[i] drafts each)
        then prefills that complete their prompt (no drafts). Returns per request the committed tokens,
        their raw log-probabilities (None unless asked); per decode, the draft's confidences (if any); and per
        request the top_logprobs most likely (token, raw log-probability) at each committed position (None
        unless asked; None for the whole step if no request asked). Every one is read from the target's
        distribution at the token's own position, the verify row: the same with and without drafts. Under
        structured output `logits` forbid what the grammar forbids and `raw` are the target's own, which
        log-probabilities report (vLLM's default); without, `raw` is `logits`."""
        device, vocab = logits.device, logits.shape[-1]
        lengths = proposal.lengths + [0] * (len(sampling) - len(proposal.lengths))
        k = max(lengths, default=0)
        starts, row = [], 0
        for length in lengths:
            starts.append(row)
            row += length + 1
        raw = logits if raw is None else raw
        logits = _penalized(logits, sampling, proposal, starts, lengths)
        argmax = argmax_rows(logits)
        counts = self.synthetic.counts(lengths) if self.synthetic is not None and k else None
        if all(s.seq.params.greedy and not s.seq.params.logprobs for s in sampling):
            return _greedy(argmax, proposal, lengths, starts, counts)
        committed = torch.full((len(sampling), k + 1), PLACEHOLDER, dtype=torch.long, device=device)
        greedy = [i for i, s in enumerate(sampling) if s.seq.params.greedy]
        seeded = [i for i, s in enumerate(sampling) if not s.seq.params.greedy and s.seq.params.seed is not None]
        sampled = [i for i, s in enumerate(sampling) if not s.seq.params.greedy and s.seq.params.seed is None]
        for group in (greedy, seeded, sampled):
            if not group:
                continue
            rows = _index([r for i in group for r in range(starts[i], starts[i] + lengths[i] + 1)], device)
            cells = [(i, j) for i in group if i < len(proposal.lengths) for j in range(lengths[i])]
            drafts = proposal.token_ids[_index([i for i, _ in cells], device), _index([j for _, j in cells], device)]
            targets, p, q, gens = argmax[rows], None, None, None
            if group is not greedy:
                params = [sampling[i].seq.params for i in group for _ in range(lengths[i] + 1)]
                p = process(logits[rows], RowParams.build(params, vocab, device))
            if group is seeded:
                # The token plain decoding would draw at each verify row's output position; drafts are
                # accepted while they equal it, as greedy ones are against the argmax (design.md §4.3).
                seeds = [sampling[i].seq.params.seed for i in group for _ in range(lengths[i] + 1)]
                positions = [sampling[i].seq.num_output_tokens + j for i in group for j in range(lengths[i] + 1)]
                targets, p = draw_at(p, seeds, positions), None
            elif group is sampled:
                q = _draft_probs(proposal, cells, device)
                gens = [sampling[i].seq.generator for i in group]
            out = rejection_sample(targets, p, drafts, q, [lengths[i] for i in group], gens,
                                   None if counts is None else [counts[i] for i in group])
            committed[_index(group, device), :out.shape[1]] = out
        logprobs, top_ids, top_lps = _logprobs(raw, committed, sampling, starts, lengths)
        host = to_host(committed, logprobs, proposal.confidences, top_ids, top_lps)
        tokens = [[t for t in r if t != PLACEHOLDER] for r in host[0]]
        lps: list[list[float] | None] = [None] * len(sampling)
        tops: list | None = None if host[3] is None else [None] * len(sampling)
        wanted = [i for i, s in enumerate(sampling) if s.seq.params.logprobs]
        for r, i in enumerate(wanted):
            lps[i] = host[1][r][:len(tokens[i])]
            if n := sampling[i].seq.params.top_logprobs:
                rows = zip(host[3][r][:len(tokens[i])], host[4][r])
                tops[i] = [list(zip(ids[:n], values[:n])) for ids, values in rows]
        confidences = None
        if host[2] is not None:
            confidences = [r[:length] for r, length in zip(host[2], proposal.lengths)]
        return tokens, lps, confidences, tops


def _greedy(argmax: torch.Tensor, proposal: Proposal, lengths: list[int], starts: list[int],
            synthetic_counts: list[int] | None = None
            ) -> tuple[list[list[int]], list[None], list[list[float]] | None, None]:
    """Every request greedy, none asking for logprobs (plain decoding's usual step): the target's argmax
    rows and the drafts cross in the step's one transfer, and acceptance (drafts equal to the argmax, then
    the argmax) is a few list comparisons on the host instead of ~20 small tensor ops, each with its own
    dispatch cost. The result is rejection_sample's greedy result."""
    host = proposal.host_token_ids
    argmax_rows, drafts, confidences = to_host(argmax, proposal.token_ids if host is None else None,
                                               proposal.confidences)
    drafts = drafts if host is None else host
    tokens = []
    for i, (start, length) in enumerate(zip(starts, lengths)):  # prefills (no drafts) come last
        if synthetic_counts is not None:
            n = synthetic_counts[i]
        else:
            n = 0
            while n < length and drafts[i][n] == argmax_rows[start + n]:
                n += 1
        tokens.append([*drafts[i][:n], argmax_rows[start + n]] if n else [argmax_rows[start]])
    if confidences is not None:
        confidences = [r[:length] for r, length in zip(confidences, proposal.lengths)]
    return tokens, [None] * len(lengths), confidences, None


def _penalized(logits: torch.Tensor, sampling: list[ScheduledSeq], proposal: Proposal, starts: list[int],
               lengths: list[int]) -> torch.Tensor:
    """The logits with each penalised request's rows penalised (sampling.penalize); the same tensor when no
    request asks for a penalty. Log-probabilities stay the raw logits' (vLLM's default)."""
    wanted = [i for i, s in enumerate(sampling) if s.seq.params.penalized]
    if not wanted:
        return logits
    logits = logits.clone()
    for i in wanted:
        seq, rows = sampling[i].seq, slice(starts[i], starts[i] + lengths[i] + 1)
        drafts = proposal.token_ids[i] if i < len(proposal.lengths) and lengths[i] else None
        logits[rows] = penalize(logits[rows], seq.params, seq.token_ids[:seq.num_prompt_tokens],
                                seq.output_token_ids, drafts)
    return logits


def _index(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _draft_probs(proposal: Proposal, cells: list[tuple[int, int]], device) -> torch.Tensor | None:
    """q rows [D, V] of the sampled group's drafts (None: every proposal in it deterministic)."""
    if proposal.probs is None or not cells:
        return None
    where = {decode: r for r, decode in enumerate(proposal.sampled)}
    return proposal.probs[_index([where[i] for i, _ in cells], device), _index([j for _, j in cells], device)]


def _logprobs(logits, committed, sampling, starts, lengths):
    """For the R requests that asked: [R, K + 1] raw log-probability of each committed token, and the N most
    likely tokens at each of those positions, ids and log-probabilities [R, K + 1, N] (N: the most any of
    them asked for; None where none did). All None when no request asked."""
    wanted = [i for i, s in enumerate(sampling) if s.seq.params.logprobs]
    if not wanted:
        return None, None, None
    k = committed.shape[1] - 1
    device = logits.device
    # Row of each (request, slot); slots past a request's verify rows repeat its last row (sliced away later).
    rows = _index([starts[i] + min(j, lengths[i]) for i in wanted for j in range(k + 1)], device)
    tokens = committed[_index(wanted, device)].clamp_min(0).view(-1, 1)
    lsm = torch.log_softmax(logits[rows], dim=-1)
    chosen = lsm.gather(1, tokens).view(len(wanted), k + 1)
    n = max(sampling[i].seq.params.top_logprobs for i in wanted)
    if not n:
        return chosen, None, None
    top = lsm.topk(n, dim=-1)
    return chosen, top.indices.view(len(wanted), k + 1, n), top.values.view(len(wanted), k + 1, n)


def prompt_logprobs(logits: torch.Tensor, items, prompt_rows) -> list:
    """Prompt logprobs from a forward's logits [R, V] (`items`' rows in order): prompt_rows holds (seq, first
    position, item index, first row within the item's rows, rows), row j predicting the prompt token at first
    position + j. Returns (seq, first position, [{token: (raw log-probability, rank)}]): the prompt token and
    the params.prompt_logprobs most likely, ranked from 1 (one host read)."""
    device = logits.device
    starts = [0]
    for it in items:
        starts.append(starts[-1] + it.num_logits)
    rows = [starts[index] + first_row + j for _, _, index, first_row, n in prompt_rows for j in range(n)]
    targets = [t for seq, pos, _, _, n in prompt_rows for t in seq.token_ids[pos:pos + n]]
    lsm = torch.log_softmax(logits[_index(rows, device)], dim=-1)
    chosen = lsm.gather(1, _index(targets, device)[:, None])[:, 0]
    rank = (lsm > chosen[:, None]).sum(dim=1) + 1
    k = max(seq.params.prompt_logprobs for seq, *_ in prompt_rows)
    top = lsm.topk(k, dim=-1) if k else None
    chosen, rank, top_ids, top_lps = to_host(chosen, rank, top and top.indices, top and top.values)
    out, i = [], 0
    for seq, pos, _, _, n in prompt_rows:
        entries = []
        for _ in range(n):
            entry = {targets[i]: (chosen[i], rank[i])}
            for j in range(seq.params.prompt_logprobs):
                entry.setdefault(top_ids[i][j], (top_lps[i][j], j + 1))
            entries.append(entry)
            i += 1
        out.append((seq, pos, entries))
    return out
