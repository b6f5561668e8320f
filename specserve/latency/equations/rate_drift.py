"""Rate drift: arrivals whose rate wanders slowly, which no renewal process (arrival_regularity.py) expresses.

A trace's counts per window can be over-dispersed by a factor that grows with the window (the Azure
conversation trace: 1.7x Poisson's variance over 10 arrivals, 4x over 54, 15x over 320): its rate drifts.
We model the arrivals as a two-state Markov-modulated process, the simplest one with that second-order
behaviour: the rate is λ·(1 ± v), each state's share of time ½, switching so that the rate's
autocorrelation is e^(−|u|/τ) (u, τ in mean gaps); within a state, gaps are a renewal process of CV c
(the fast bursts the renewal term already covers). Counts in a window of x mean gaps then have

    Var N(x)/x = I_c(x) + 2v²·τ·(1 − (τ/x)·(1 − e^(−x/τ))),       I_c(x) = 1 + company(x, c) − x,

I_c the renewal part (for any stationary arrivals company(x) = x + Var N(x)/x − 1). `fit_rate_drift`
takes c from the gaps measured against their local rate (the 2·_LOCAL arrivals around each), then v² and τ
by least squares of that dispersion curve against the measured one on log-spaced windows.

Latency: when τ is long against a request's lifetime (λ·L mean gaps), each state lasts long enough to
settle, so a request arriving in a state sees that state's latency, and requests arrive in proportion to
the rate:

    L̄ = [(1 − v)·L(λ·(1 − v)) + (1 + v)·L(λ·(1 + v))] / 2,

larger than L(λ) by more than the extra company alone (Jensen: L is convex in λ). It is infinite when
the busy state saturates, λ·(1 + v) ≥ 1/C2, although a busy spell of finite length leaves a finite
backlog: the quasi-static average has no answer there. Over a horizon of H mean gaps (a bench run's
measured requests, whose own mean rate is λ) only the drift within it counts: the rate's variance about the
horizon's mean is v²·(1 − φ(H/τ)), φ(y) = 2(y − 1 + e^(−y))/y² the share a window's mean keeps.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import check_cv, company

_LOCAL = 25            # arrivals each side of a gap that measure its local rate
_MIN_ARRIVALS = 200    # fewer cannot tell a drift from a few bursts


@dataclass(frozen=True, slots=True)
class RateDrift:
    """Fast gaps' CV `cv`, the rate's relative variance `variance` (v²) and its correlation length
    `correlation` (τ, in mean gaps). variance 0 is a renewal process of CV `cv`."""

    cv: float = 1.0
    variance: float = 0.0
    correlation: float = 1.0

    def __post_init__(self) -> None:
        check_cv(self.cv)
        if not (0.0 <= self.variance < 1.0):
            raise SpecServeError(f"rate drift variance must be in [0, 1), got {self.variance!r}")
        if not (self.correlation > 0.0 and math.isfinite(self.correlation)):
            raise SpecServeError(f"rate drift correlation must be > 0 mean gaps, got {self.correlation!r}")

    def dispersion(self, window) -> np.ndarray:
        """Var N/N of counts in windows of `window` mean gaps."""
        x = np.asarray(window, dtype=float)
        tau = self.correlation
        drift = 2.0 * self.variance * tau * (1.0 - tau / x * -np.expm1(-x / tau))
        return 1.0 + company(x, self.cv) - x + drift

    def within(self, horizon: float | None) -> float:
        """v² about the mean of a horizon of `horizon` mean gaps (None: all of it, v²)."""
        if horizon is None or not math.isfinite(horizon):
            return self.variance
        y = max(float(horizon), 1e-9) / self.correlation
        kept = 1.0 - y / 3.0 if y < 1e-4 else 2.0 * (y - 1.0 + math.exp(-y)) / y ** 2
        return self.variance * (1.0 - kept)


def dispersion(arrivals_s, windows) -> np.ndarray:
    """Measured Var N/N of the counts in windows of `windows` mean gaps, sliding over the arrivals' span."""
    t = np.sort(np.asarray(arrivals_s, dtype=float))
    x = (t - t[0]) * (t.size - 1) / (t[-1] - t[0])
    out = []
    for w in np.atleast_1d(windows):
        starts = np.linspace(0.0, x[-1] - w, 4000)
        n = np.searchsorted(x, starts + w) - np.searchsorted(x, starts)
        out.append(n.var() / n.mean())
    return np.array(out)


def fast_cv(arrivals_s) -> float:
    """CV of the gaps measured against their local rate: the mean of the 2·_LOCAL gaps around each gap, itself
    left out (it would pull the ratio towards 1, and the CV down). Dividing by a mean of n = 2·_LOCAL gaps
    inflates the squared CV by a factor 1 + (1 + c²)/n, taken back out."""
    t = np.sort(np.asarray(arrivals_s, dtype=float))
    gaps = np.diff(t)
    i = np.arange(gaps.size)
    lo, hi = np.maximum(i - _LOCAL, 0), np.minimum(i + _LOCAL + 1, t.size - 1)
    local = gaps * (hi - lo - 1) / (t[hi] - t[lo] - gaps)
    measured = (local.std() / local.mean()) ** 2
    return float(np.clip(math.sqrt(measured / (1.0 + (1.0 + measured) / (2 * _LOCAL))), 0.05, 4.0))


def fit_rate_drift(arrivals_s) -> RateDrift:
    """The drift of a stream of arrival times (s), from its counts per window (module docstring)."""
    from scipy.optimize import least_squares

    t = np.asarray(arrivals_s, dtype=float)
    if t.size < _MIN_ARRIVALS or not np.all(np.isfinite(t)) or np.ptp(t) <= 0:
        raise SpecServeError(f"fitting a rate drift needs at least {_MIN_ARRIVALS} finite, distinct arrival "
                             f"times, got {t.size}")
    c = fast_cv(t)
    windows = np.geomspace(1.0, t.size / 20.0, 24)
    measured = dispersion(t, windows)

    def residual(p: np.ndarray) -> np.ndarray:
        return RateDrift(c, math.exp(p[0]), math.exp(p[1])).dispersion(windows) / measured - 1.0

    hi = (math.log(0.95), math.log(float(t.size)))
    fit = least_squares(residual, x0=(math.log(0.05), math.log(t.size / 50.0)),
                        bounds=((math.log(1e-6), 0.0), hi))
    return RateDrift(c, math.exp(fit.x[0]), math.exp(fit.x[1]))


def over_drift(latency_at: Callable[[float], float], rate: float, drift: RateDrift,
               horizon: float | None = None) -> float:
    """Mean latency of the requests when the rate drifts about `rate` within a horizon of `horizon` mean
    gaps: each of the two states' latency `latency_at(state rate)`, weighed by the requests arriving in it."""
    v = math.sqrt(drift.within(horizon))
    if v == 0.0:
        return float(latency_at(rate))
    return 0.5 * ((1.0 - v) * float(latency_at(rate * (1.0 - v))) + (1.0 + v) * float(latency_at(rate * (1.0 + v))))
