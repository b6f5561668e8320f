"""p95/p99 approximation: a quantile is a multiple of each part of the mean.

    Q_q(λ) = a_q · base + b_q · load         (per metric: e2e, ttft, tpot; per quantile: p95, p99)

base is the mean a lone request sees (C1 for E2E) and load what the B = λ·L requests in flight add when a
request meets them all (L − C1 for Poisson arrivals; regular arrivals spare the average request some of
them, not the unlucky ones a tail is about: `LatencyModel.parts(tail=True)`). a_q is
the spread a lone request already has (lengths, acceptance luck); b_q the tail factor of the load-induced
delay — an exponential waiting time would give b = ln 20 ≈ 3.0 at p95 and ln 100 ≈ 4.6 at p99, so the
fitted b says how bursty contention is on this server. a, b ≥ 0 are fitted by non-negative least squares
with relative residuals on the runs' reported quantiles, using the fitted mean models for base and load,
so their error is the one a prediction makes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specserve.latency.fitting.regression import FittedCoefficients, nonneg_weighted_lstsq
from specserve.latency.records.runs import BenchRun

METRICS = ("e2e", "ttft", "tpot")
QUANTILES = ("p95", "p99")
EXPONENTIAL_FACTOR = {"p95": float(np.log(20.0)), "p99": float(np.log(100.0))}

# (metric, run) -> (base, load) seconds, from the fitted mean models at the run's achieved rate
Parts = Callable[[str, BenchRun], tuple[float, float]]


@dataclass(frozen=True, slots=True)
class TailModel:
    coefficients: dict[str, dict[str, FittedCoefficients]]  # metric -> quantile -> (a, b)

    def predict(self, metric: str, quantile: str, base: float, load: float) -> float | None:
        fitted = self.coefficients.get(metric, {}).get(quantile)
        if fitted is None:
            return None
        if not (np.isfinite(base) and np.isfinite(load)):
            return float("inf")
        return fitted["a"] * base + fitted["b"] * load


def fit_tails(runs: Sequence[BenchRun], parts: Parts) -> TailModel:
    """Fit every (metric, quantile) that at least 3 runs report (2 coefficients need a residual)."""
    out: dict[str, dict[str, FittedCoefficients]] = {}
    for metric in METRICS:
        rows = [(parts(metric, r), getattr(r, metric)) for r in runs]
        for quantile in QUANTILES:
            data = [(p, s.quantile(quantile)) for p, s in rows if s.quantile(quantile) is not None
                    and all(np.isfinite(p))]
            if len(data) < 3:
                continue
            X = np.array([p for p, _ in data])
            y = np.array([q for _, q in data])
            theta, keep, cis = nonneg_weighted_lstsq(X, y, 1.0 / y)
            out.setdefault(metric, {})[quantile] = FittedCoefficients.build(
                ("a", "b"), theta, keep, cis, y, X @ theta)
    return TailModel(out)
