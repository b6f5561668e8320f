"""Synthetic acceptance: a benchmark-only verification that accepts draft tokens at set rates.

Random-weight models accept almost nothing, so they cannot say how speculation behaves on a shape we have
no trained draft for (a large MoE target, a GPU step at batch 32). Under `"rejection_sample_method":
"synthetic"` (vLLM's option names; SGLang and TensorRT-LLM have the same switch) every step still drafts and
verifies at full cost, but how many of a request's l drafts are kept is drawn, not compared: draft j
(0-based) survives with the conditional probability c_j that it is accepted given drafts 0..j-1 were,

    c_j = r_j / r_{j-1}   (r_{-1} = 1),   r_j: the configured unconditional rate of position j,

and the request commits its first n drafts plus the target's token at row n (its argmax, or its sample
there), as verification commits a recovered or bonus token. The output is then not the target's
distribution: the option is never on by default, refused unless named, and every response says so.

`synthetic_acceptance_length` L (mean tokens committed per step at k drafts, bonus included) becomes rates
with one conditional rate c for every position: 1 + c + c^2 + ... + c^k = L, solved by bisection.
"""
from __future__ import annotations

from specserve.errors import SpecServeError


def rates_for_length(length: float, k: int) -> list[float]:
    """Unconditional per-position rates [c, c^2, ..., c^k] whose mean committed tokens at k drafts is `length`."""
    if not 1 <= length <= k + 1:
        raise SpecServeError(f"synthetic_acceptance_length must be in [1, num_speculative_tokens + 1 = {k + 1}], "
                             f"got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if sum(c ** j for j in range(k + 1)) < length else (lo, c)
    c = (lo + hi) / 2
    return [c ** (j + 1) for j in range(k)]


def check_rates(rates, k: int) -> list[float]:
    """vLLM's rule: k numbers in [0, 1], non-increasing (position j needs every earlier one accepted)."""
    if (not isinstance(rates, list) or len(rates) != k
            or not all(isinstance(r, (int, float)) and 0 <= r <= 1 for r in rates)):
        raise SpecServeError(f"synthetic_acceptance_rates must be a list of num_speculative_tokens = {k} numbers "
                             f"in [0, 1], got {rates!r}")
    if any(b > a for a, b in zip(rates, rates[1:])):
        raise SpecServeError(f"synthetic_acceptance_rates must not increase (position j is reached only when "
                             f"every earlier draft was accepted), got {rates}")
    return [float(r) for r in rates]


class SyntheticAcceptance:
    """Draws each request's number of accepted drafts. Its own seeded generator, so that a benchmark run
    repeats, and request seeds are left to the tokens the target commits."""

    def __init__(self, rates: list[float], seed: int = 0):
        import numpy as np  # here: the config module that checks rates is imported by `specserve --help`

        self.rates = rates
        previous = [1.0] + rates[:-1]
        self.conditional = np.array([r / p if p > 0 else 0.0 for r, p in zip(rates, previous)])
        self.rng = np.random.default_rng(seed)

    def counts(self, lengths: list[int]) -> list[int]:
        """Accepted drafts of each request, n_i <= lengths[i]: the leading positions whose draw fell under
        their conditional rate."""
        k = max(lengths, default=0)
        if not k:
            return [0] * len(lengths)
        leading = (self.rng.random((len(lengths), k)) < self.conditional[:k]).cumprod(axis=1).sum(axis=1)
        return [min(int(n), length) for n, length in zip(leading, lengths)]
