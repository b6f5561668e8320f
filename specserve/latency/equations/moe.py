"""Mixture-of-experts coverage correction (docs/design.md §2.3).

A step that routes T tokens, each to m of M experts, touches a fraction φ(T) = 1 − (1 − m/M)^T of the
expert weights, so each demand is C = C_u + φ·C_s (C_u: the part every step pays, C_s: the expert weights
a fully covered step reads). T grows with the number in flight B = λ·L, so L = C1(φ)/(1 − λ·C2(φ)) holds
L on both sides and is solved numerically.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import EQUAL, Lifetimes, company, loaded_latency
from specserve.latency.equations.formulas import Demands, check_rate


@dataclass(frozen=True, slots=True)
class MoeExperts:
    """m experts active per token out of M."""

    active: int
    experts: int

    def __post_init__(self) -> None:
        if not (isinstance(self.active, int) and isinstance(self.experts, int)
                and 0 < self.active <= self.experts):
            raise SpecServeError(f"MoE needs 0 < active <= experts, got {self.active!r} of {self.experts!r}")

    def coverage(self, tokens: float) -> float:
        """φ(T) = 1 − (1 − m/M)^T, the expected fraction of experts a step over T tokens touches."""
        t = float(tokens)
        if not (t >= 0.0):
            raise SpecServeError(f"routed tokens must be >= 0, got {tokens!r}")
        return 1.0 - (1.0 - self.active / self.experts) ** t


def routed_tokens(in_flight: float, tokens_per_request: float) -> float:
    """Tokens a step routes: B requests × (k+1) verified tokens each. A request in flight always routes
    its own tokens, so B is floored at 1 (at λ → 0 a lone request still touches some experts)."""
    return max(float(in_flight), 1.0) * tokens_per_request


@dataclass(frozen=True, slots=True)
class MoeDemands:
    """Split demands: (c1u, c2u) paid by every step, (c1s, c2s) scaled by expert coverage φ."""

    c1u: float
    c1s: float
    c2u: float
    c2s: float

    def __post_init__(self) -> None:
        for name in ("c1u", "c1s", "c2u", "c2s"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v >= 0.0):
                raise SpecServeError(f"MoE coefficient {name} must be finite and >= 0, got {v!r}")
        if self.c1u + self.c1s <= 0.0:
            raise SpecServeError("MoE demands need c1u + c1s > 0")

    def at(self, phi: float) -> Demands:
        return Demands(self.c1u + phi * self.c1s, self.c2u + phi * self.c2s)

    @property
    def full(self) -> Demands:
        return self.at(1.0)


def moe_latency(rate: float, demands: MoeDemands, experts: MoeExperts, tokens_per_request: float,
                cv: float = 1.0, lifetimes: Lifetimes = EQUAL) -> float:
    """Solve L = C1(φ) + C2(φ)·company(λL) (= C1(φ)/(1 − λ·C2(φ)) for Poisson arrivals, cv = 1; see
    arrivals.py), φ = φ(max(λL, 1)·(k+1)), for the smallest root (the stable branch
    a system reaches starting empty). inf when λ ≥ 1/C2 at full coverage: past that a burst that fills the
    batch never drains, so no steady state is safe to promise.
    """
    from scipy.optimize import brentq

    lam = check_rate(rate)
    if not (tokens_per_request >= 1.0):
        raise SpecServeError(f"tokens per request per step must be >= 1, got {tokens_per_request!r}")
    full = demands.full
    if lam * full.c2 >= 1.0:
        return math.inf

    def excess(latency: float) -> float:
        d = demands.at(experts.coverage(routed_tokens(lam * latency, tokens_per_request)))
        return latency - d.c1 - d.c2 * float(company(lam * latency, cv, lifetimes))

    # excess < 0 at the lone-request latency (coverage only grows with L) and >= 0 at the full-coverage
    # latency (coverage <= 1); scanning between them finds the first sign change, which brentq refines.
    lo = demands.at(experts.coverage(tokens_per_request)).c1
    hi = float(loaded_latency(full.c1, full.c2, lam, cv, lifetimes))
    if excess(lo) >= 0.0:
        return lo
    prev = lo
    for i in range(1, 65):
        point = lo * (hi / lo) ** (i / 64)
        if excess(point) >= 0.0:
            return float(brentq(excess, prev, point, xtol=1e-12, rtol=1e-10))
        prev = point
    return hi  # excess(hi) >= 0 analytically; reached only through rounding at the last grid point
