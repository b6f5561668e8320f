"""Expected tokens committed per verification cycle, E(α, k) — docs/design.md §2.2.

A cycle drafts k tokens, verifies them in one target pass, keeps the longest accepted prefix and adds
one token from the target, so 1 ≤ E ≤ k + 1.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from specserve.errors import SpecServeError


def check_k(k: int) -> int:
    """A speculation length: a non-negative integer (0 = plain decoding)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise SpecServeError(f"speculation length k must be an integer >= 0, got {k!r}")
    return k


def check_alpha(alpha: float) -> float:
    """A per-token acceptance probability in (0, 1]."""
    a = float(alpha)
    if not (0.0 < a <= 1.0):  # also rejects NaN
        raise SpecServeError(f"acceptance probability alpha must be in (0, 1], got {alpha!r}")
    return a


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α) for i.i.d. acceptance; k + 1 at α = 1, 1 at k = 0."""
    check_k(k)
    if k == 0:
        return 1.0  # no draft: every cycle is one plain decode step, whatever alpha is
    a = check_alpha(alpha)
    if a == 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def expected_tokens_positional(alphas: Sequence[float]) -> float:
    """E = 1 + Σ_{j=1..k} Π_{i≤j} α_i, with α_i the acceptance of position i given 1..i−1 accepted.

    Unlike the i.i.d. α, a positional α_i may be 0: a measured position that never survived is real data.
    """
    total, survive = 1.0, 1.0
    for i, a in enumerate(alphas, start=1):
        a = float(a)
        if not (0.0 <= a <= 1.0):
            raise SpecServeError(f"acceptance of draft position {i} must be in [0, 1], got {a!r}")
        survive *= a
        total += survive
    return total


def solve_alpha(expected: float, k: int) -> float:
    """The i.i.d. α with E(α, k) = expected (E is strictly increasing in α); 0 when nothing was accepted."""
    from scipy.optimize import brentq

    check_k(k)
    if k == 0:
        raise SpecServeError("alpha is undefined without speculation (k = 0)")
    e = float(expected)
    if not (1.0 <= e <= k + 1.0 + 1e-9):
        raise SpecServeError(f"mean acceptance length {e!r} is outside [1, k+1] = [1, {k + 1}]")
    if e >= k + 1.0:
        return 1.0
    if e == 1.0:
        return 0.0
    # E(α) − e changes sign on (0, 1): E(0+) = 1 < e < k + 1 = E(1).
    return float(brentq(lambda a: expected_tokens(a, k) - e, 1e-12, 1.0, xtol=1e-12))


def acceptance_length_from_spec(spec: Mapping | None, k: int) -> float | None:
    """Mean tokens committed per cycle from bench `spec` stats; None when the stats cannot give it.

    Preference order follows how directly each field measures E: the reported mean acceptance length,
    then 1 + accepted/drafts (vLLM's definition), then 1 + acceptance_rate·k (exact when every draft has k
    tokens).
    """
    if not spec:
        return None
    value = spec.get("mean_acceptance_length")
    if value is None and spec.get("num_drafts"):
        accepted = spec.get("num_accepted_tokens")
        value = None if accepted is None else 1.0 + accepted / spec["num_drafts"]
    if value is None and spec.get("acceptance_rate") is not None and k > 0:
        value = 1.0 + float(spec["acceptance_rate"]) * k
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value) or value < 1.0:
        raise SpecServeError(f"mean acceptance length must be >= 1, got {value!r}")
    return value


def positional_acceptance(drafts: int, accepted_per_position: Sequence[int]) -> list[float] | None:
    """α_j = P(position j accepted | positions < j accepted) = accepted_j / accepted_{j−1}, with
    accepted_0 = drafts; None without counts. A position never reached gets 0."""
    if drafts <= 0 or not accepted_per_position or min(accepted_per_position) < 0:
        return None  # absent, or counts no server can produce: no positional view rather than a wrong one
    alphas, previous = [], drafts
    for count in accepted_per_position:
        alphas.append(0.0 if previous <= 0 else min(count / previous, 1.0))
        previous = count
    return alphas
