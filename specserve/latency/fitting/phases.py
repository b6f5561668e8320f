"""TTFT and TPOT models: each a load-independent part plus a part that grows with the number in flight B.

    TTFT(λ) = (t1 + [k>0]·t1d) + P_busy(B)·(tb + k·tb_d) + M(B)·(t2 + k·t2d)
        t1: a lone request's prefill; t1d: the draft model's own prefill of the prompt;
        tb, tb_d: the fixed cost of the running batch's step (one verify pass, k draft passes) that a new
        prompt waits for or shares whenever anyone is decoding — the batch is non-empty with probability
        P_busy(B) (1 − e^(−B) for Poisson arrivals);
        t2: time each request the arrival finds in flight (M(B) of them; B for Poisson) adds to that
        step; t2d: the extra per token it drafts.

    TPOT(λ) = [(s1v + k·s1d) + company(B)·(s2v + k·s2d)] / E
        a cycle costs one verify pass plus k draft steps (s1v, s1d), each request in flight adds its own
        verify and draft work to the shared step (s2v, s2d) — company(B) of them over a request's
        lifetime (B for Poisson) — and a cycle commits E tokens.

B(λ) = λ·L(λ) comes from the E2E model (Little's law), so all three metrics share one notion of load;
P_busy, M and company turn it into what a request meets under the runs' arrival regularity (arrivals.py).
The coefficients are fitted by non-negative least squares of the measured means on the measured
B̂ = λ·L (relative residuals).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import busy_on_arrival, company, seen_on_arrival
from specserve.latency.fitting.regression import FittedCoefficients, RowSpace, nonneg_weighted_lstsq
from specserve.latency.records.runs import BenchRun

NAMES = {"ttft": ("t1", "t1d", "tb", "tb_d", "t2", "t2d"), "tpot": ("s1v", "s1d", "s2v", "s2d")}


def base_features(metric: str, k: int, expected: float) -> np.ndarray:
    if metric == "ttft":
        return np.array([1.0, 1.0 if k > 0 else 0.0])
    return np.array([1.0, k]) / expected


def load_shape(metric: str, k: int, expected: float) -> np.ndarray:
    """How a configuration scales each load term: (1, k) for TTFT, (1, k)/E for TPOT."""
    return np.array([1.0, float(k)]) if metric == "ttft" else np.array([1.0, k]) / expected


def load_features(metric: str, k: int, expected: float, in_flight: float, cv: float = 1.0) -> np.ndarray:
    shape = load_shape(metric, k, expected)
    if metric == "ttft":
        return np.concatenate([busy_on_arrival(in_flight, cv) * shape, seen_on_arrival(in_flight, cv) * shape])
    return company(in_flight, cv) * shape


@dataclass(frozen=True, slots=True)
class PhaseModel:
    metric: str  # "ttft" or "tpot"
    coefficients: FittedCoefficients
    base_space: RowSpace
    load_space: RowSpace

    def parts(self, k: int, expected: float, in_flight: float, cv: float = 1.0) -> tuple[float, float]:
        """(load-independent seconds, seconds added by the B requests in flight)."""
        theta = self.coefficients.vector(NAMES[self.metric])
        base = float(base_features(self.metric, k, expected) @ theta[:2])
        return base, float(load_features(self.metric, k, expected, in_flight, cv) @ theta[2:])

    def estimable(self, k: int, expected: float) -> bool:
        return (self.base_space.contains(base_features(self.metric, k, expected))
                and self.load_space.contains(load_shape(self.metric, k, expected)))


def fit_phase(metric: str, runs: Sequence[BenchRun]) -> PhaseModel:
    if metric not in NAMES:
        raise SpecServeError(f"unknown phase metric {metric!r}")
    if len(runs) < 2:
        raise SpecServeError(f"need at least 2 runs to fit {metric.upper()}, got {len(runs)}")
    observed = np.array([getattr(r, metric).mean for r in runs])
    base = np.array([base_features(metric, r.k, r.acceptance_length) for r in runs])
    shape = np.array([load_shape(metric, r.k, r.acceptance_length) for r in runs])
    load = np.array([load_features(metric, r.k, r.acceptance_length, r.in_flight, r.cv) for r in runs])
    X = np.hstack([base, load])
    theta, keep, cis = nonneg_weighted_lstsq(X, observed, 1.0 / observed)
    coefficients = FittedCoefficients.build(NAMES[metric], theta, keep, cis, observed, X @ theta)
    return PhaseModel(metric, coefficients, RowSpace.of(base), RowSpace.of(shape))
