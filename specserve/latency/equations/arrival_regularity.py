"""Arrival regularity: how many other requests a request shares the server with.

docs/design.md §2.1's L = C1 + B·C2 with B = λ·L charges every request for λ·L others in flight over its lifetime.
That is exact for Poisson arrivals only. Real streams are often more regular (a rate limiter, a client
pacing its calls) or burstier (a trace's spikes). With independent arrival gaps of coefficient of
variation c (a renewal process) and lifetimes L, the others a request meets over its lifetime number on
average

    company(x) = (2/x)·∫_0^x M(v) dv,        x = λ·L,

where M(v), the renewal function, is the mean number of arrivals within v mean gaps after an arrival
(and, gaps being independent, before one). Poisson (c = 1): M(v) = v and company(x) = x, docs/design.md §2.1's B.
Regular arrivals (c < 1) leave a request alone while x < 1 and charge it x − (1 − c²) at high load;
bursty ones (c > 1) charge x + c² − 1. The mean latency is then the smallest root of

    L = C1 + C2·company(λ·L),

which is C1/(1 − λ·C2) at c = 1. A new arrival finds M(x) others still in flight, the step running
with probability P(first gap ≤ x) (1 − e^(−x) for Poisson): the TTFT model's load terms.

Mixed lifetimes. The formula above takes every request to live equally long. With lifetimes ℓ_i (in
mean gaps: x_i = λ·ℓ_i) the time request j spends beside request i, summed over the renewal process's
offsets, is D(x_i) − D((x_i − x_j)⁺) + D(x_j) − D((x_j − x_i)⁺) with D(x) = ∫_0^x M. The mean latency
needs that summed over i and divided by Σ x_i (each request is slowed in proportion to its own lifetime,
so longer ones count more):

    company(x) = 2·Σ_i w_i·D(x·r_i)/x − 2·Σ_ij w_i·w_j·D(x·(r_i − r_j)⁺)/x,

r_i the relative lifetimes (weighted mean 1, `Lifetimes`). Equal lifetimes give (2/x)·D(x) back, Poisson
gives x for any mix. A short request arriving just behind a long one meets it however regular the gaps,
so a mix of lengths loses part of the regular-arrival discount: x − (1 − c²)·Σ w_i·w_j·min(r_i, r_j) at
high load.

Gaps are taken Gamma-distributed with shape 1/c², as `specserve bench --burstiness c` draws them (vLLM's
`--burstiness` is that shape itself); M is then a sum of Gamma CDFs, tabulated once per c and interpolated.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """Relative lifetimes r_i of a traffic's requests with their weights w_i (Σ w_i·r_i = 1). A request's
    lifetime is taken proportional to its output length (its decode steps); the prefill's share is left
    out. `EQUAL`, one point, is the fixed-length traffic of the plain formula."""

    values: tuple[float, ...] = (1.0,)
    weights: tuple[float, ...] = (1.0,)

    @classmethod
    def of(cls, lengths: Sequence[float], weights: Sequence[float] | None = None, points: int = 16) -> Lifetimes:
        """From output lengths (one per request, compressed to `points` equal-count groups) or from
        weighted length classes. EQUAL when the longest is within 2 % of the shortest."""
        g = np.asarray(lengths, dtype=float)
        if g.size == 0 or not np.all(np.isfinite(g)) or np.any(g <= 0):
            raise SpecServeError("lifetimes need positive, finite lengths")
        if weights is None:
            g = np.sort(g)
            groups = np.array_split(g, min(points, g.size))
            g, w = np.array([a.mean() for a in groups]), np.array([a.size for a in groups], dtype=float)
        else:
            w = np.asarray(weights, dtype=float)
            if w.shape != g.shape or np.any(w <= 0):
                raise SpecServeError("lifetime weights must be positive, one per length")
        if g.max() <= 1.02 * g.min():
            return EQUAL
        w = w / w.sum()
        r = g / float(w @ g)
        return cls(tuple(round(float(v), 4) for v in r), tuple(round(float(v), 6) for v in w))

    @property
    def equal(self) -> bool:
        return len(self.values) == 1

    @property
    def cv(self) -> float:
        """Coefficient of variation of the lifetimes (0 for EQUAL): √(Σ w_i·r_i² − 1)."""
        return math.sqrt(max(sum(w * r * r for r, w in zip(self.values, self.weights)) - 1.0, 0.0))


EQUAL = Lifetimes()


def company(load, cv: float = 1.0, lifetimes: Lifetimes = EQUAL) -> np.ndarray:
    """Mean number of others a request shares the server with over its lifetime, at load x = λ·L
    (lifetime-weighted over `lifetimes`)."""
    if cv == 1.0:
        return np.asarray(load, dtype=float)
    return _on_curve(np.asarray(load, dtype=float), *_curve(check_cv(cv), lifetimes))


def _on_curve(x: np.ndarray, table: np.ndarray, shift, k2) -> np.ndarray:
    """company from a `_curve`: linear interpolation on _GRID, x + shift + k2/x past it. One curve
    (table [grid]) for any x, or one per row (table [n, grid], shift and k2 [n, 1], x [n, m])."""
    pos = np.clip(x, 0.0, _GRID_END) / _GRID[1]
    i = np.minimum(pos.astype(int), len(_GRID) - 2)
    frac = pos - i
    lo, hi = (table[i], table[i + 1]) if table.ndim == 1 else (np.take_along_axis(table, i, -1),
                                                                 np.take_along_axis(table, i + 1, -1))
    return np.where(x <= _GRID_END, lo + (hi - lo) * frac, x + shift + k2 / np.maximum(x, _GRID_END))


@functools.lru_cache(maxsize=256)
def _curve(cv: float, lifetimes: Lifetimes) -> tuple[np.ndarray, float, float]:
    """company on _GRID and its continuation past it, x + shift + k2/x: ∫M = x²/2 + (c² − 1)·x/2 + K + o(1)
    gives shift = (c² − 1)·Σ w_i·w_j·min(r_i, r_j) (module docstring; c² − 1 for equal lifetimes), and k2
    matches the table's end."""
    if lifetimes.equal:
        table, shift = _tables(cv)[1], cv ** 2 - 1.0
    else:
        r, w = np.array(lifetimes.values), np.array(lifetimes.weights)
        x = _GRID[:, None]

        def integral(y: np.ndarray) -> np.ndarray:  # D(y) = ∫_0^y M
            return 0.5 * y * company(y, cv)

        gaps = np.clip(r[:, None] - r[None, :], 0.0, None).ravel()       # (r_i − r_j)⁺, [n·n]
        pair_w = (w[:, None] * w[None, :]).ravel()
        total = 2.0 * integral(x * r[None, :]) @ w - 2.0 * integral(x * gaps[None, :]) @ pair_w
        table = np.divide(total, _GRID, out=np.zeros_like(_GRID), where=_GRID > 0)
        shift = (cv ** 2 - 1.0) * float(w @ np.minimum(r[:, None], r[None, :]) @ w)
    return table, shift, (table[-1] - _GRID_END - shift) * _GRID_END


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


def loaded_latency(c1, c2, rate, cv=1.0, lifetimes: Lifetimes | Sequence[Lifetimes] = EQUAL) -> np.ndarray:
    """Smallest L with L = C1 + C2·company(λ·L), elementwise; inf where λ·C2 ≥ 1 (no steady state).
    `lifetimes`: one for all elements or one per element (of the broadcast arrays, flattened).

    Bracket: L = C1 leaves the right side ≥ L, and company(x) ≤ x + c² (Lorden's bound on M; x + 2c² + 2
    for mixed lifetimes) makes L = (C1 + C2·bound)/(1 − λ·C2) leave it ≤ L. company grows, but can grow
    faster than x (regular arrivals step from alone to company near x = 1), so the first sign change on a
    grid is refined by bisection.
    """
    c1, c2, lam, cv = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (c1, c2, rate, cv)))
    shape = c1.shape
    c1, c2, lam, cv = (a.ravel() for a in (c1, c2, lam, cv))
    mix = [lifetimes] * c1.size if isinstance(lifetimes, Lifetimes) else list(lifetimes)
    if len(mix) != c1.size:
        raise SpecServeError(f"need one Lifetimes per element ({c1.size}), got {len(mix)}")
    load = lam * c2
    out = np.full(c1.shape, np.inf)
    ok = load < 1.0
    poisson = ok & (cv == 1.0)
    out[poisson] = c1[poisson] / (1.0 - load[poisson])
    rest = np.flatnonzero(ok & ~poisson)
    if rest.size:
        curves = [_curve(check_cv(cv[i]), mix[i]) for i in rest]
        bound = np.array([cv[i] ** 2 if mix[i].equal else 2.0 * cv[i] ** 2 + 2.0 for i in rest])
        out[rest] = _fixed_point(c1[rest], c2[rest], lam[rest], bound, curves)
    return out.reshape(shape)


def _fixed_point(c1: np.ndarray, c2: np.ndarray, lam: np.ndarray, bound: np.ndarray, curves: list) -> np.ndarray:
    """Every element at once, each with its own company curve (`_curve`), looked up on the shared grid."""
    tables = np.stack([t for t, _, _ in curves])                            # [n, grid]
    shift, k2 = (np.array([c[j] for c in curves])[:, None] for j in (1, 2))  # [n, 1]

    def excess(latency: np.ndarray) -> np.ndarray:  # latency [n, m]; > 0 below the root
        return c1[:, None] + c2[:, None] * _on_curve(lam[:, None] * latency, tables, shift, k2) - latency

    lo, hi = c1, (c1 + c2 * bound) / (1.0 - lam * c2)
    steps = lo[:, None] + (hi - lo)[:, None] * np.linspace(0.0, 1.0, 65)[None, :]
    below = excess(steps) > 0.0
    first = np.argmin(below, axis=1)  # first grid point at or past a root (hi always is)
    first = np.where(below.all(axis=1), 64, np.maximum(first, 1))
    rows = np.arange(len(c1))
    a, b = steps[rows, first - 1], steps[rows, first]
    done = ~below[rows, 0]  # L = C1 already balances: nobody to share with
    for _ in range(60):
        mid = 0.5 * (a + b)
        up = excess(mid[:, None])[:, 0] > 0.0
        a, b = np.where(up, mid, a), np.where(up, b, mid)
    return np.where(done, c1, 0.5 * (a + b))


def run_cv(process: str | None, burstiness: float | None, realised: float | None = None) -> float | None:
    """The CV of a bench run's arrival gaps: the one its measured requests met (`arrival_gap_cv`, written by
    `specserve bench` since 2026-11-29; kept within the modelled range) where the record has it, else the
    process's it states: Poisson 1, Gamma its burstiness. A few dozen arrivals of a process can be far from
    its CV, and a trace states none (docs/experiments/latency-validation.md, latency21)."""
    if isinstance(realised, (int, float)) and not isinstance(realised, bool) and math.isfinite(realised) and realised > 0:
        return float(min(max(realised, _CV_RANGE[0]), _CV_RANGE[1]))
    if process == "poisson":
        return 1.0
    if process == "gamma" and isinstance(burstiness, (int, float)):
        return check_cv(burstiness)
    return None
