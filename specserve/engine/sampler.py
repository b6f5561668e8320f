"""Sampling: temperature, top-k, top-p, and per-request seeded draws.

The same two functions serve plain decoding and speculative verification, so that a request with no
draft tokens samples exactly as it would without speculation (same probabilities, same random draws).
"""
from __future__ import annotations

import torch

from specserve.engine.sampling_params import SamplingParams


def to_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits: [N, V] float32, one row per params entry (no greedy rows) -> probabilities [N, V] after
    temperature, top-k and top-p (the distribution the request samples from)."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    logits = logits / temps[:, None]
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _truncate(logits, top_k, top_p)
    return torch.softmax(logits, dim=-1)


def _truncate(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    if all(p >= 1.0 for p in top_p):
        # Only top-k: no full sort needed, a k-th largest threshold per row suffices.
        k = torch.tensor([min(k if k > 0 else vocab, vocab) for k in top_k], device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1)[:, None])
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    drop = rank[None, :] >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device)
    drop = mass_before > p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """probs: [N, V]; one draw per row from that row's request generator (exponential race: argmax of
    p / E with E ~ Exp(1) picks token i with probability p_i)."""
    out = []
    for row, gen in zip(probs, generators):
        e = torch.empty_like(row).exponential_(generator=gen)
        out.append(int((row / e).argmax()))
    return out


def chosen_logprobs(logits: torch.Tensor, token_ids: list[int]) -> list[float]:
    """Log-probability of each chosen token under the model's raw distribution. logits: [N, V]."""
    ids = torch.tensor(token_ids, device=logits.device)[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, ids)[:, 0].tolist()
