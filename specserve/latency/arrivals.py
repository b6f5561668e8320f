"""Arrival regularity: how many other requests a request shares the server with.

SPEC §2's L = C1 + B·C2 with B = λ·L charges every request for λ·L others in flight over its lifetime.
That is exact for Poisson arrivals only. Real streams are often more regular (a rate limiter, a client
pacing its calls) or burstier (a trace's spikes). With independent arrival gaps of coefficient of
variation c (a renewal process) and lifetimes L, the others a request meets over its lifetime number on
average

    company(x) = (2/x)·∫_0^x M(v) dv,        x = λ·L,

where M(v), the renewal function, is the mean number of arrivals within v mean gaps after an arrival
(and, gaps being independent, before one). Poisson (c = 1): M(v) = v and company(x) = x, SPEC §2's B.
Regular arrivals (c < 1) leave a request alone while x < 1 and charge it x − (1 − c²) at high load;
bursty ones (c > 1) charge x + c² − 1. The mean latency is then the smallest root of

    L = C1 + C2·company(λ·L),

which is C1/(1 − λ·C2) at c = 1. A new arrival finds M(x) others still in flight, the step running
with probability P(first gap ≤ x) (1 − e^(−x) for Poisson): the TTFT model's load terms.

Gaps are taken Gamma-distributed with shape 1/c², as `specserve bench --burstiness c` draws them (vLLM's
`--burstiness` is that shape itself); M is then a sum of Gamma CDFs, tabulated once per c and interpolated.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from specserve.errors import SpecServeError

_GRID_END = 64.0  # tabulated loads x = λL; beyond it M(x) − x and company(x) − x have settled
_GRID = np.linspace(0.0, _GRID_END, 4097)
_CV_RANGE = (0.05, 4.0)


def check_cv(cv: float) -> float:
    c = float(cv)
    if not (_CV_RANGE[0] <= c <= _CV_RANGE[1]):
        raise SpecServeError(f"arrival CV must be in [{_CV_RANGE[0]:g}, {_CV_RANGE[1]:g}] "
                             f"(1 = Poisson), got {cv!r}")
    return c


@functools.lru_cache(maxsize=16)
def _tables(cv: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(M, company, P(first gap ≤ x)) on _GRID for unit-mean Gamma gaps with CV cv."""
    from scipy.stats import gamma

    shape = 1.0 / cv ** 2
    x = _GRID
    renewal, integral = np.zeros_like(x), np.zeros_like(x)
    # S_n, the n-th arrival time, is Gamma(n·shape, scale 1/shape) with mean n:
    #   M(x) = Σ P(S_n ≤ x),   ∫_0^x M = Σ E[(x − S_n)⁺] = Σ [x·P(S_n ≤ x) − n·P(S'_n ≤ x)],
    # S'_n ~ Gamma(n·shape + 1, scale 1/shape) (the size-biased S_n). Terms vanish once n ≫ x.
    n_max = int(_GRID_END + 12.0 * math.sqrt(_GRID_END) * max(cv, 1.0) + 32)
    for n in range(1, n_max + 1):
        below = gamma.cdf(x, n * shape, scale=1.0 / shape)
        renewal += below
        integral += x * below - n * gamma.cdf(x, n * shape + 1.0, scale=1.0 / shape)
    company = np.divide(2.0 * integral, x, out=np.zeros_like(x), where=x > 0)
    return renewal, company, gamma.cdf(x, shape, scale=1.0 / shape)


def _lookup(table: np.ndarray, load, tail) -> np.ndarray:
    x = np.asarray(load, dtype=float)
    return np.where(x <= _GRID_END, np.interp(x, _GRID, table), tail(np.maximum(x, _GRID_END)))


def company(load, cv: float = 1.0) -> np.ndarray:
    """Mean number of others a request shares the server with over its lifetime, at load x = λ·L."""
    if cv == 1.0:
        return np.asarray(load, dtype=float)
    table = _tables(check_cv(cv))[1]
    # ∫M = x²/2 + (c² − 1)·x/2 + K + o(1), so company = x + c² − 1 + 2K/x past the grid; K from its end.
    k2 = (table[-1] - _GRID_END - (cv ** 2 - 1.0)) * _GRID_END
    return _lookup(table, load, lambda x: x + cv ** 2 - 1.0 + k2 / x)


def seen_on_arrival(load, cv: float = 1.0) -> np.ndarray:
    """Mean number of requests a new arrival finds in flight, M(x)."""
    if cv == 1.0:
        return np.asarray(load, dtype=float)
    table = _tables(check_cv(cv))[0]
    return _lookup(table, load, lambda x: x + (table[-1] - _GRID_END))  # M − x settles exponentially fast


def busy_on_arrival(load, cv: float = 1.0) -> np.ndarray:
    """Probability that a new arrival finds anyone in flight: P(the last gap < x)."""
    x = np.asarray(load, dtype=float)
    if cv == 1.0:
        return -np.expm1(-x)
    return np.where(x <= _GRID_END, np.interp(x, _GRID, _tables(check_cv(cv))[2]), 1.0)


def loaded_latency(c1, c2, rate, cv=1.0) -> np.ndarray:
    """Smallest L with L = C1 + C2·company(λ·L), elementwise; inf where λ·C2 ≥ 1 (no steady state).

    Bracket: L = C1 leaves the right side ≥ L, and company(x) ≤ x + c² (Lorden's bound on M) makes
    L = (C1 + C2·c²)/(1 − λ·C2) leave it ≤ L. company grows, but can grow faster than x (regular arrivals
    step from alone to company near x = 1), so the first sign change on a grid is refined by bisection.
    """
    c1, c2, lam, cv = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (c1, c2, rate, cv)))
    load = lam * c2
    out = np.full(c1.shape, np.inf)
    ok = load < 1.0
    poisson = ok & (cv == 1.0)
    out[poisson] = c1[poisson] / (1.0 - load[poisson])
    for c in np.unique(cv[ok & ~poisson]):
        sel = ok & (cv == c)
        out[sel] = _fixed_point(c1[sel], c2[sel], lam[sel], float(c))
    return out


def _fixed_point(c1: np.ndarray, c2: np.ndarray, lam: np.ndarray, cv: float) -> np.ndarray:
    lo, hi = c1, (c1 + c2 * cv ** 2) / (1.0 - lam * c2)

    def excess(latency: np.ndarray, c1=c1, c2=c2, lam=lam) -> np.ndarray:  # > 0 below the root
        return c1 + c2 * company(lam * latency, cv) - latency

    steps = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, 65)[None, :]
    below = excess(steps, c1[:, None], c2[:, None], lam[:, None]) > 0.0
    first = np.argmin(below, axis=1)  # first grid point at or past a root (hi always is)
    first = np.where(below.all(axis=1), 64, np.maximum(first, 1))
    rows = np.arange(len(c1))
    a, b = steps[rows, first - 1], steps[rows, first]
    done = ~below[rows, 0]  # L = C1 already balances: nobody to share with
    for _ in range(60):
        mid = 0.5 * (a + b)
        up = excess(mid) > 0.0
        a, b = np.where(up, mid, a), np.where(up, b, mid)
    return np.where(done, c1, 0.5 * (a + b))


def run_cv(process: str | None, burstiness: float | None) -> float | None:
    """The CV of a bench run's arrival gaps when its record states it: Poisson 1, Gamma its burstiness."""
    if process == "poisson":
        return 1.0
    if process == "gamma" and isinstance(burstiness, (int, float)):
        return check_cv(burstiness)
    return None
