"""Sampling primitives shared by the engine's sampler and the draft proposers: temperature, top-k and top-p
as batched tensor ops, and per-request draws (inverse-CDF: one uniform per sampled token).

An unseeded request draws from its own torch.Generator (device ops, no host synchronisation). A seeded
request's uniform at output position t is a function of (seed, t) alone (`position_uniforms`), so the token
it samples there is the same whatever shares its batch and however many draws speculation made before it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.seeding import position_uniforms


@dataclass(slots=True)
class RowParams:
    """Per-row processing parameters as tensors, built once per batch of rows. top_k / top_p are None when
    no row uses them (the common case skips the sort entirely)."""
    temperature: torch.Tensor        # [N]
    top_k: torch.Tensor | None       # [N] long, vocab where the row has no top-k
    top_p: torch.Tensor | None       # [N]
    max_top_k: int                   # largest finite top-k, known on the host (sizes torch.topk)

    @classmethod
    def build(cls, params: list, vocab: int, device, dtype=torch.float32) -> "RowParams":
        """params: one SamplingParams per row (no greedy rows)."""
        temps = torch.tensor([p.temperature for p in params], dtype=dtype, device=device)
        # top_k above the vocabulary means "all of it": clamped on the host, never built as a huge tensor.
        ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
        top_k = torch.tensor(ks, dtype=torch.long, device=device) if min(ks, default=vocab) < vocab else None
        ps = [p.top_p for p in params]
        top_p = torch.tensor(ps, dtype=dtype, device=device) if min(ps, default=1.0) < 1.0 else None
        return cls(temps, top_k, top_p, max(ks, default=vocab))


def process(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    """logits [N, V] float32 -> probabilities [N, V] after temperature, top-k and top-p."""
    logits = logits / rows.temperature[:, None]
    if rows.top_p is not None:
        logits = _top_k_top_p(logits, rows)
    elif rows.top_k is not None:
        # Only top-k: no full sort, a k-th largest threshold per row suffices.
        kth = logits.topk(rows.max_top_k, dim=-1).values.gather(-1, (rows.top_k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, rows: RowParams) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if rows.top_k is not None:
        rank = torch.arange(vocab, device=logits.device)
        sorted_logits = sorted_logits.masked_fill(rank[None, :] >= rows.top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly better tokens
    drop = mass_before > rows.top_p[:, None]
    drop[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def to_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    """logits: [N, V] float32, one row per params entry (no greedy rows) -> the probabilities [N, V] the
    request samples from."""
    return process(logits, RowParams.build(params, logits.shape[-1], logits.device, logits.dtype))


def uniforms(generators: list[torch.Generator], size: int, device, dtype=torch.float32) -> torch.Tensor:
    """[len(generators), size] U[0, 1) draws, row i from generators[i] (one device op per row)."""
    noise = torch.empty(len(generators), size, dtype=dtype, device=device)
    for row, gen in zip(noise, generators):
        row.uniform_(generator=gen)
    return noise


def draw(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """[N, V] non-negative weights (not necessarily normalised) -> [N] tokens, token t of row i with
    probability probs[i, t] / Σ probs[i], from one uniform of generators[i]."""
    return inverse_cdf(probs, uniforms(generators, 1, probs.device, torch.float64))


def draw_at(probs: torch.Tensor, seeds: list[int], positions: list[int]) -> torch.Tensor:
    """[N, V] weights -> [N] tokens, row i drawn with the uniform of output position positions[i] of a request
    seeded with seeds[i] (seeding.position_uniforms)."""
    u = torch.from_numpy(position_uniforms(seeds, positions)).view(-1, 1).to(probs.device)
    return inverse_cdf(probs, u)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, V] weights, [N, 1] float64 uniforms -> [N] tokens: the first token whose cumulative weight exceeds
    u times the total. The cumulative sums are float64, so that the 49,152 additions of a vocabulary do not
    blur the tail's mass (float32 could shift up to ~1e-3 of probability between tokens). A token of weight
    0 is never drawn. (The exponential race, argmax p / E over V Exp(1) draws, is as exact but draws V
    numbers per row: 0.95 ms a row at V = 49,152 on the CPU, against 0.08-0.2 ms for this.)"""
    cdf = probs.double().cumsum(dim=-1)                                    # [N, V]
    total = cdf[:, -1:]                                                    # [N, 1]
    token = torch.searchsorted(cdf, u * total, right=True)[:, 0]           # first t with cdf[t] > u * total
    return torch.minimum(token, (cdf < total).sum(dim=-1))  # u * total rounded up to total: the last weighted token


def penalize(logits: torch.Tensor, params, prompt: list[int], output: list[int], drafts: torch.Tensor | None
             ) -> torch.Tensor:
    """vLLM's penalties on one request's rows [n, V] (n = its drafts + 1), a new tensor: row j predicts the
    token after the output so far and drafts[:j], which count as output there (a verify row must be
    penalised as plain decoding would have penalised that position). presence and frequency penalties
    subtract per token in the output (once, or per occurrence); a repetition penalty divides a positive
    logit (multiplies a negative one) of every token seen in the prompt or the output."""
    n, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(n, vocab, device=device)
    if output:
        counts += torch.bincount(torch.tensor(output, dtype=torch.long, device=device), minlength=vocab)[:vocab]
    if drafts is not None and n > 1:
        seen = torch.zeros(n - 1, vocab, device=device).scatter_(1, drafts[:n - 1, None], 1.0)
        counts[1:] += seen.cumsum(0)
    return apply_penalties(logits, params, counts, prompt_mask(params, prompt, vocab, device))


def penalize_draft(logits: torch.Tensor, params, prompt: list[int], output: list[int], drafts: torch.Tensor,
                   vocab: int, vocab_map: torch.Tensor | None) -> torch.Tensor:
    """The same penalties on a draft model's row [1, Vd] proposing the token after the output and `drafts`
    (target ids): the draft proposes from the distribution the target will verify against, so penalties
    do not lower acceptance. vocab_map [Vd]: the target id of each draft head row (None: the same ids)."""
    tokens = torch.cat([torch.tensor(output, dtype=torch.long, device=logits.device), drafts])
    counts = torch.bincount(tokens, minlength=vocab)[None, :vocab].to(logits.dtype)
    mask = prompt_mask(params, prompt, vocab, logits.device)
    if vocab_map is not None:
        counts, mask = counts[:, vocab_map], None if mask is None else mask[vocab_map]
    return apply_penalties(logits, params, counts, mask)


def prompt_mask(params, prompt: list[int], vocab: int, device) -> torch.Tensor | None:
    """[V] bool: the prompt's tokens, which the repetition penalty counts as seen (None without it)."""
    if params.repetition_penalty == 1.0:
        return None
    mask = torch.zeros(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(prompt, dtype=torch.long, device=device)] = True
    return mask


def apply_penalties(logits: torch.Tensor, params, counts: torch.Tensor, prompt: torch.Tensor | None
                    ) -> torch.Tensor:
    """logits, counts [n, V] (each row's output-token counts), prompt [V] bool or None -> penalised logits."""
    out = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    if prompt is not None:
        r = params.repetition_penalty
        out = torch.where((counts > 0) | prompt, torch.where(out > 0, out / r, out * r), out)
    return out
