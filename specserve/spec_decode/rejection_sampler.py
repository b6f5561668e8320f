"""Lossless verification of draft tokens (speculative sampling, Leviathan et al. 2023; Chen et al. 2023),
vectorized over a flattened batch. Why it is lossless: docs/design.md §4.

Glossary
- N: requests in the call; l_i: draft tokens of request i (0 = plain decoding); K = max l_i.
- verify rows: request i owns l_i + 1 consecutive rows of the flattened [T, V] target tensors
  (T = Σ (l_i + 1)): one per draft position plus the bonus position.
- draft rows: request i owns l_i consecutive rows of the flattened draft tensors (D = Σ l_i); the
  cumulative draft counts locate them.
- p: the target's distribution at a verify row, after the request's temperature / top-k / top-p.
- q: the draft's distribution at a draft row, processed identically (0 outside a reduced draft
  vocabulary); a deterministic proposer (prompt lookup) has q = one-hot at its token.
- accepted tokens: the leading drafts x_j with u_j · q(x_j) < p(x_j), u_j ~ U[0, 1).
- recovered token: at the first rejected position, a sample from normalize(max(0, p − q)).
- bonus token: when all l_i drafts are accepted, a sample from p at row l_i.
Every request commits its accepted tokens plus exactly one recovered or bonus token, and the committed
sequence is distributed exactly as if sampled from p token by token. Greedy requests accept while the
draft equals the target's argmax and then commit the argmax.

Random draws come from each request's own generator, in a fixed order (l_i uniforms for acceptance, then
one for the committed token's inverse-CDF draw), so a request with l_i = 0 draws exactly what plain
decoding draws.
Everything stays on the device: the caller transfers the result once.
"""
from __future__ import annotations

import torch

from specserve.sampling_ops import draw

PLACEHOLDER = -1  # output slots past a request's committed tokens


def rejection_sample(
    target_argmax: torch.Tensor,        # [T] argmax of each verify row
    target_probs: torch.Tensor | None,  # [T, V] p of each verify row; None: every request is greedy
    draft_token_ids: torch.Tensor,      # [D] drafts x, flattened
    draft_probs: torch.Tensor | None,   # [D, V] q; None: proposals are deterministic (one-hot q)
    num_draft: list[int],               # [N] l_i, on the host
    generators: list[torch.Generator] | None = None,  # [N] sampled requests' generators; None: greedy
    synthetic_counts: list[int] | None = None,  # [N] accepted drafts drawn by spec_decode/synthetic.py
) -> torch.Tensor:
    """Returns [N, K + 1] committed tokens per request (accepted drafts + one recovered or bonus token),
    padded with PLACEHOLDER; on the device. With `synthetic_counts` (benchmarks only) request i keeps its
    first n_i drafts whatever p and q say, then the target's own token at row n_i (argmax, or a draw from p)."""
    device = target_argmax.device
    n_req, k = len(num_draft), max(num_draft, default=0)
    lengths = torch.tensor(num_draft, dtype=torch.long, device=device)  # [N]
    draft_start = torch.cumsum(lengths, 0) - lengths                    # [N] first draft row of each
    row_start = draft_start + torch.arange(n_req, device=device)         # [N] first verify row of each
    pos = torch.arange(k, device=device)
    valid = pos[None, :] < lengths[:, None]                              # [N, K]
    draft_rows = torch.where(valid, draft_start[:, None] + pos, 0)       # [N, K]
    verify_rows = torch.where(valid, row_start[:, None] + pos, 0)        # [N, K]
    x = draft_token_ids[draft_rows] if k else draft_rows                 # [N, K]

    if synthetic_counts is not None:
        accepted = pos[None, :] < torch.tensor(synthetic_counts, dtype=torch.long, device=device)[:, None]
    elif target_probs is None:
        accepted = (x == target_argmax[verify_rows]) & valid
    else:
        p_x = target_probs[verify_rows, x]                                        # [N, K]
        q_x = draft_probs[draft_rows, x] if draft_probs is not None else torch.ones_like(p_x)
        u = torch.zeros_like(p_x)
        for row, gen, length in zip(u, generators, num_draft):
            if length:
                row[:length].uniform_(generator=gen)
        accepted = (u * q_x < p_x) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)              # [N] n_i <= l_i
    final_row = row_start + num_accepted                                  # [N]

    if target_probs is None:
        last = target_argmax[final_row]
    else:
        p = target_probs[final_row]                                       # [N, V]
        rejected = (num_accepted < lengths)[:, None]                      # [N, 1] recovered, not bonus
        if k and synthetic_counts is None:
            at = num_accepted.clamp(max=k - 1)[:, None]
            if draft_probs is not None:
                q = draft_probs[draft_rows.gather(1, at)[:, 0]]            # [N, V]
            else:
                q = torch.zeros_like(p).scatter_(1, x.gather(1, at), 1.0)
            residual = torch.where(rejected, (p - q).clamp_min(0), p)
            # p == q up to rounding: rejection had probability ~0, so sample from p itself.
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
        else:
            residual = p
        last = draw(residual, generators)

    slots = torch.arange(k + 1, device=device)[None, :]
    padded = torch.cat([x, x.new_zeros(n_req, 1)], dim=1)
    out = torch.where(slots < num_accepted[:, None], padded, PLACEHOLDER)
    return out.scatter_(1, num_accepted[:, None], last[:, None])
