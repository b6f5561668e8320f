"""Lossless verification of draft tokens (speculative sampling, Leviathan et al. 2023; Chen et al. 2023).

Glossary
- p: the target's distribution at a position, after the request's temperature / top-k / top-p.
- q: the draft's distribution at the same position, processed identically (q is 0 outside a reduced
  draft vocabulary; a deterministic proposer such as n-gram lookup has q = one-hot at its token).
- accepted tokens: the leading draft tokens x_j that pass `u_j < p(x_j) / q(x_j)`, u_j ~ U[0, 1).
- recovered token: at the first rejected position, a sample from normalize(max(0, p - q)).
- bonus token: when all l drafts are accepted, a sample from p at position l + 1.
Every request commits its accepted tokens plus exactly one recovered or bonus token, and the committed
sequence is distributed exactly as if sampled from p token by token. Greedy requests (temperature 0)
accept while the draft equals the target's argmax and then commit the argmax.
A request with l = 0 draws nothing but its bonus sample, exactly like plain decoding.
"""
from __future__ import annotations

import torch

from specserve.engine.sampler import sample


def rejection_sample(
    target_argmax: torch.Tensor,        # [N, K+1] argmax of the target logits at each verify position
    target_probs: torch.Tensor | None,  # [N, K+1, V] p (rows of greedy requests are unused); None if all greedy
    draft_token_ids: torch.Tensor,      # [N, K] proposed tokens x (padding past num_draft[i] is ignored)
    draft_probs: torch.Tensor | None,   # [N, K, V] q; None: proposals are deterministic (one-hot q)
    num_draft: list[int],               # l_i <= K drafts per request
    generators: list[torch.Generator | None],  # None for greedy requests
) -> list[list[int]]:
    """Returns each request's committed tokens: accepted drafts + one recovered or bonus token."""
    committed = []
    argmax = target_argmax.tolist()
    drafts = draft_token_ids.tolist()
    for i, (l, gen) in enumerate(zip(num_draft, generators)):
        x = drafts[i][:l]
        if gen is None:  # greedy: exact argmax matching
            n = 0
            while n < l and x[n] == argmax[i][n]:
                n += 1
            committed.append(x[:n] + [argmax[i][n]])
            continue
        p = target_probs[i]
        n = 0
        if l:
            ids = draft_token_ids[i, :l, None]
            p_x = p[:l].gather(-1, ids)[:, 0]
            q_x = draft_probs[i, :l].gather(-1, ids)[:, 0] if draft_probs is not None else torch.ones_like(p_x)
            u = torch.rand(l, generator=gen, dtype=p_x.dtype, device=gen.device)
            accepted = (u * q_x < p_x).tolist()
            while n < l and accepted[n]:
                n += 1
        if n < l:  # recovered token from the residual distribution max(0, p - q)
            if draft_probs is not None:
                residual = (p[n] - draft_probs[i, n]).clamp_min_(0)
            else:
                residual = p[n].clone()
                residual[x[n]] = 0
            if float(residual.sum()) <= 0:  # p == q up to rounding: rejection had probability ~0
                residual = p[n]
            last = sample(residual[None], [gen])[0]
        else:  # bonus token
            last = sample(p[l][None], [gen])[0]
        committed.append(x[:n] + [last])
    return committed
