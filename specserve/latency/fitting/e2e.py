"""Mean end-to-end latency: per-configuration (C1, C2) fits and the pooled six-coefficient fit (docs/design.md §2).

Both use one procedure: a non-negative least-squares fit of L on B̂ = λ·L (L = C1 + B̂·C2, the initial guess)
refined by nonlinear least squares of L(λ) = C1/(1 − λ·C2). Residuals are relative, (L̂ − L)/L: latency
spans an order of magnitude across load and relative residuals weigh every point alike, as MAPE does.

The prefill prior. c2p, what each request in flight adds through its prefill, is physically the prefill
time itself: a request in flight for L seconds sees λ·L = B arrivals, and each arrival's prefill holds
up the running batch once. With one output length and similar E in every configuration, g/E barely
varies, so the runs cannot tell c2p from the per-cycle verify term c2v (the least-squares fit then puts
the load on whichever it likes, and extrapolating to another E, e.g. plain decoding from speculative
runs, fails). The pooled fit therefore adds the pseudo-observation that c2p equals a lone request's
measured time to first token, to within about 25 %; runs that do separate the two (several output
lengths) outweigh it.

The draft floor, c2d ≥ c2v. Per cycle a co-resident request adds c2v + k·c2d to everyone's latency: its
row in the verify pass (plus any per-request work of a cycle) and, per drafted token, another verify row
plus its share of the draft passes (docs/design.md §2.2: a draft forward plus the marginal cost of its
verify row). A drafted token therefore adds at least what a row adds, and the fit holds c2d ≥ c2v by
fitting c2d − c2v ≥ 0 in its place. Without the bound, speculative runs alone (no plain decoding to pin c2v) can put load on c2v
that belongs to the drafts, and plain decoding predicted from them (k = 0: C2 = c2p + g·c2v) comes out far
too slow. `--no-draft-floor` turns it off, for a server whose per-request work per cycle outweighs
its draft (then c2v may exceed c2d).
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import EQUAL, Lifetimes, company, loaded_latency
from specserve.latency.equations.formulas import Demands, check_rate
from specserve.latency.equations.moe import MoeDemands, MoeExperts, moe_latency, routed_tokens
from specserve.latency.equations.slots import slot_delay
from specserve.latency.fitting.regression import (FittedCoefficients, RowSpace, confidence_intervals, covariance,
                                          nonneg_weighted_lstsq)
from specserve.latency.records.runs import BenchRun

SIX = ("c1p", "c1v", "c1d", "c2p", "c2v", "c2d")
_MAX_START_LOAD = 0.95  # the nonlinear fit starts with every run's λ·C2 at most this


def demand_features(k: int, expected: float, output_tokens: float) -> np.ndarray:
    """u with C1 = u·(c1p, c1v, c1d) and C2 = u·(c2p, c2v, c2d): [1, g/E, g·k/E]."""
    cycles = output_tokens / expected
    return np.array([1.0, cycles, cycles * k])


def parameter_names(base: Sequence[str], moe: bool) -> tuple[str, ...]:
    """θ = [C1 terms, C2 terms]; with MoE each term splits into an always-paid part and a `_s` part ∝ φ."""
    half = len(base) // 2
    c1, c2 = list(base[:half]), list(base[half:])
    if moe:
        c1, c2 = c1 + [n + "_s" for n in c1], c2 + [n + "_s" for n in c2]
    return tuple(c1 + c2)


def lone_prefill(runs: Sequence[BenchRun]) -> float:
    """A lone request's time to first token: the mean TTFT of the runs with at most one request in flight
    on average, else that of the least loaded run."""
    lone = [r.ttft.mean for r in runs if r.in_flight <= 1.0]
    return statistics.fmean(lone) if lone else min(runs, key=lambda r: r.in_flight).ttft.mean


PRIOR_SPREAD = 0.25  # the prefill prior: c2p is the lone TTFT to within about ±25 % (one standard deviation)


def fit_demands(rate: np.ndarray, latency: np.ndarray, X: np.ndarray,
                priors: Sequence[tuple[int, float]] = (), cv: np.ndarray | float = 1.0,
                lifetimes: Sequence[Lifetimes] | None = None, floors: Sequence[tuple[int, int]] = (),
                slots: int | None = None):
    """θ = (θ1, θ2) ≥ 0 minimising Σ((L̂ − L)/L)² with L̂ = X·θ1 + X·θ2·company(λ·L̂) (X·θ1/(1 − λ·X·θ2)
    for Poisson arrivals, `cv` = 1; each run's `lifetimes`, equal if not given; arrivals.py), plus, for
    each prior (j, v), the pseudo-observation θ_j = v. A prior is weighed against the runs' own scatter s
    (the RMS relative residual of the fit without priors): its residual is (θ_j − v)/v · s/PRIOR_SPREAD, so
    precise data that identify θ_j override it and it decides only directions the data leave flat.
    Each floor (i, j) bounds θ_i ≥ θ_j: the fit runs in θ' = P⁻¹·θ, with θ'_i = θ_i − θ_j ≥ 0.
    `slots`: the server runs at most that many requests at once; L̂ gains the wait the cap adds (slots.py).
    Returns (θ, kept columns of θ', CIs of θ)."""
    return fit_demands_with_covariance(rate, latency, X, priors, cv, lifetimes, floors, slots)[:3]


def fit_demands_with_covariance(rate: np.ndarray, latency: np.ndarray, X: np.ndarray,
                                priors: Sequence[tuple[int, float]] = (), cv: np.ndarray | float = 1.0,
                                lifetimes: Sequence[Lifetimes] | None = None, floors: Sequence[tuple[int, int]] = (),
                                slots: int | None = None):
    """fit_demands, and the linearised covariance of θ (zero rows and columns for coefficients held at 0;
    None without residual freedom), which `latency plan` carries into its choice of k."""
    cv = np.broadcast_to(np.asarray(cv, dtype=float), rate.shape)
    mix = [EQUAL] * len(rate) if lifetimes is None else list(lifetimes)
    P = np.eye(2 * X.shape[1])
    for above, below in floors:
        P[above, below] = 1.0
    theta, keep, cis, relative, cov = _fit_demands(rate, latency, X, (), cv, mix, P, slots)
    if priors:
        scatter = float(np.sqrt(np.mean(relative ** 2)))
        theta, keep, cis, _, cov = _fit_demands(rate, latency, X, [(j, v, scatter / PRIOR_SPREAD) for j, v in priors],
                                                cv, mix, P, slots)
    return theta, keep, cis, cov


def _fit_demands(rate: np.ndarray, latency: np.ndarray, X: np.ndarray, priors: Sequence[tuple[int, float, float]],
                 cv: np.ndarray, lifetimes: list[Lifetimes], P: np.ndarray, slots: int | None = None):
    """The fit above; each prior (j, v, w) adds the residual w·(θ_j − v)/v. Also returns the runs'
    relative residuals (L̂ − L)/L."""
    from scipy.optimize import least_squares

    n, q = X.shape
    in_flight = np.array([company(b, c, m) for b, c, m in zip(rate * latency, cv, lifetimes)])  # each run's company
    A, y, weights = np.hstack([X, in_flight[:, None] * X]) @ P, latency, 1 / latency
    for j, value, weight in priors:
        A, y, weights = np.vstack([A, P[j]]), np.append(y, value), np.append(weights, weight / value)
    fitted, keep, _ = nonneg_weighted_lstsq(A, y, weights)  # θ' (θ = P·θ')
    if not keep:
        raise SpecServeError("latency data carry no information to fit (all features are zero)")
    free = np.array(keep)

    def full(theta_free: np.ndarray) -> np.ndarray:
        return P[:, free] @ theta_free

    # The linear guess can put the busiest runs past saturation (λ·C2 ≥ 1), where C1/(1 − λ·C2) means
    # nothing: start from C2 scaled back until every run is below it.
    start = fitted[free]
    busiest = float(np.max(rate * (X @ full(start)[q:])))
    if busiest >= _MAX_START_LOAD:
        start = start * np.where(free >= q, _MAX_START_LOAD / busiest, 1.0)
    if slots is not None:  # and below the busy slots' saturation, scaling every coefficient alike
        theta = full(start)
        busiest = float(np.max(rate * (X @ theta[:q] + (slots - 1) * (X @ theta[q:])) / slots))
        if busiest >= _MAX_START_LOAD:
            start = start * _MAX_START_LOAD / busiest

    def predict(theta_free: np.ndarray) -> np.ndarray:
        theta = full(theta_free)
        c2 = X @ theta[q:]
        room = 1.0 - rate * c2
        # Past saturation the model has no finite latency. The penalty grows with the overshoot and does
        # not scale with C1: a clamped C1/ε let C1 -> 0 'fit' a saturated point (and ruin every other).
        c1 = X @ theta[:q]
        loaded = loaded_latency(c1, np.where(room > 1e-6, c2, 0.0), rate, cv, lifetimes)
        if slots is not None:  # busy slots saturate too (slots.py): the same penalty past that
            room = np.minimum(room, 1.0 - rate * np.minimum(loaded, c1 + c2 * (slots - 1)) / slots)
            delays = [slot_delay(L, a, b, lam, slots, c, m.cv)[0] if ok else 0.0
                      for L, a, b, lam, c, m, ok in zip(loaded, c1, c2, rate, cv, lifetimes, room > 1e-6)]
            loaded = loaded + np.array(delays)
        return np.where(room > 1e-6, loaded, latency * 1e3 * (1.0 + 1e3 * (1e-6 - room)))

    def residuals(theta_free: np.ndarray) -> np.ndarray:
        relative = (predict(theta_free) - latency) / latency
        theta = full(theta_free)
        return np.append(relative, [weight * (theta[j] - value) / value for j, value, weight in priors])

    res = least_squares(residuals, np.maximum(start, 1e-12), bounds=(0.0, np.inf), method="trf",
                        x_scale="jac")
    best = res.x if np.sum(res.fun ** 2) <= np.sum(residuals(start) ** 2) else start
    # Intervals on θ = P·θ' from the linearised covariance of θ' (least-squares Jacobian at the answer).
    jac = res.jac if best is res.x else _jacobian(residuals, best)
    cis = [None] * (2 * q)
    transform = P[np.ix_(free, free)]
    for j, ci in zip(keep, confidence_intervals(best, jac, residuals(best), transform)):
        cis[j] = ci
    kept_cov = covariance(jac, residuals(best), transform)
    cov = None
    if kept_cov is not None:
        cov = np.zeros((2 * q, 2 * q))
        cov[np.ix_(free, free)] = kept_cov
    theta = np.zeros(2 * q)
    theta[free] = full(best)[free]  # a coefficient the data cannot identify is held at 0
    return theta, keep, cis, residuals(best)[:n], cov


def _jacobian(f, x: np.ndarray) -> np.ndarray:
    """Forward-difference Jacobian of the vector function f at x."""
    f0, steps = f(x), 1e-6 * np.maximum(np.abs(x), 1e-9)
    return np.column_stack([(f(x + h * e) - f0) / h for h, e in zip(steps, np.eye(len(x)))])


def latency_of(split: MoeDemands, rate: float, moe: MoeExperts | None, k: int, cv: float = 1.0,
               lifetimes: Lifetimes = EQUAL, slots: int | None = None) -> float:
    """L = C1 + C2·company(λL) for dense-weight models (closed form for Poisson arrivals, cv = 1); the
    MoE fixed point otherwise (k + 1 tokens per request). `slots`: plus what a cap on the requests
    running at once adds (slots.py; with the full-coverage demands for MoE)."""
    if moe is not None:
        latency = moe_latency(rate, split, moe, k + 1, cv, lifetimes)
    elif cv == 1.0:
        latency = split.full.latency(rate)
    else:
        latency = float(loaded_latency(split.full.c1, split.full.c2, check_rate(rate), cv, lifetimes))
    return latency + slot_delay(latency, split.full.c1, split.full.c2, rate, slots, cv, lifetimes.cv)[0]


def slot_wait_of(split: MoeDemands, rate: float, moe: MoeExperts | None, k: int, cv: float,
                 lifetimes: Lifetimes, slots: int | None) -> float:
    """Mean seconds a request waits for one of `slots` before it runs (0 without a cap; slots.py)."""
    if slots is None:
        return 0.0
    latency = latency_of(split, rate, moe, k, cv, lifetimes)
    return slot_delay(latency, split.full.c1, split.full.c2, rate, slots, cv, lifetimes.cv)[1]


def _coverage_columns(runs: Sequence[BenchRun], moe: MoeExperts, U: np.ndarray) -> np.ndarray:
    """[U, φ·U] with φ at each run's observed in-flight count: the measured load, so the fit stays
    closed-form; prediction then solves the fixed point (moe_latency)."""
    phi = np.array([moe.coverage(routed_tokens(r.in_flight, r.k + 1)) for r in runs])
    return np.hstack([U, phi[:, None] * U])


@dataclass(frozen=True, slots=True)
class E2EModel:
    """Mean E2E latency for any (k, E, g) from pooled coefficients (or one configuration's C1, C2)."""

    coefficients: FittedCoefficients
    moe: MoeExperts | None
    space: RowSpace  # the configurations' feature rows: which (k, E, g) the data can speak for
    pooled: bool = True  # False: a single configuration's (C1, C2), valid only for that configuration
    arrival_cv: float = 1.0  # the fitted runs' arrival CV: the traffic predictions are for unless told
    slots: int | None = None  # requests the server runs at once, the rest queueing (None: no cap)

    def features(self, k: int, expected: float, output_tokens: float) -> np.ndarray:
        return demand_features(k, expected, output_tokens) if self.pooled else np.ones(1)

    def split(self, k: int, expected: float, output_tokens: float) -> MoeDemands:
        u = self.features(k, expected, output_tokens)
        names = parameter_names(SIX if self.pooled else ("C1", "C2"), self.moe is not None)
        theta = self.coefficients.vector(names).reshape(4 if self.moe else 2, -1)
        if self.moe is None:
            return MoeDemands(float(u @ theta[0]), 0.0, float(u @ theta[1]), 0.0)
        return MoeDemands(*(float(u @ row) for row in theta))

    def demands(self, k: int, expected: float, output_tokens: float) -> Demands:
        """(C1, C2) at full expert coverage (exact for dense-weight models)."""
        return self.split(k, expected, output_tokens).full

    def latency(self, rate: float, k: int, expected: float, output_tokens: float, cv: float | None = None,
                lifetimes: Lifetimes = EQUAL) -> float:
        return latency_of(self.split(k, expected, output_tokens), rate, self.moe, k,
                          self.arrival_cv if cv is None else cv, lifetimes, self.slots)

    def slot_wait(self, rate: float, k: int, expected: float, output_tokens: float, cv: float | None = None,
                  lifetimes: Lifetimes = EQUAL) -> float:
        """Mean seconds a request waits for a slot before it runs (0 without a cap)."""
        return slot_wait_of(self.split(k, expected, output_tokens), rate, self.moe, k,
                            self.arrival_cv if cv is None else cv, lifetimes, self.slots)

    def estimable(self, k: int, expected: float, output_tokens: float) -> bool:
        return self.space.contains(self.features(k, expected, output_tokens))


def fit_e2e(runs: Sequence[BenchRun], moe: MoeExperts | None = None, pooled: bool = True,
            prefill_prior: bool = True, draft_floor: bool = True, slots: int | None = None) -> E2EModel:
    """Pooled: the six coefficients across all configurations (E, g, k per run), c2p drawn towards a lone
    request's TTFT unless `prefill_prior` is false (or the model is MoE, whose c2p splits in two), and
    c2d ≥ c2v unless `draft_floor` is false (dense weights only). Not pooled: one configuration's (C1, C2).
    `slots`: the server runs at most that many requests at once (slots.py)."""
    if len(runs) < 2:
        raise SpecServeError(f"need at least 2 pre-saturation runs to fit latency, got {len(runs)}")
    rate = np.array([r.achieved_rate for r in runs])
    latency = np.array([r.e2e.mean for r in runs])
    U = (np.array([demand_features(r.k, r.acceptance_length, r.output_tokens) for r in runs]) if pooled
         else np.ones((len(runs), 1)))
    X = U if moe is None else _coverage_columns(runs, moe, U)
    names = parameter_names(SIX if pooled else ("C1", "C2"), moe is not None)
    priors = []
    if pooled and moe is None and prefill_prior:
        priors = [(names.index("c2p"), lone_prefill(runs))]
    floors = [(names.index("c2d"), names.index("c2v"))] if pooled and moe is None and draft_floor else []
    cv = np.array([r.cv for r in runs])
    theta, keep, cis, cov = fit_demands_with_covariance(rate, latency, X, priors, cv, [r.lifetimes for r in runs],
                                                        floors, slots)
    typical = float(np.median(cv))  # the traffic predictions are for unless told (1 = Poisson)
    # The fit may leave a configuration with C1 = 0 only through degenerate data; report it as such.
    provisional = E2EModel(FittedCoefficients.build(names, theta, keep, cis, latency, latency),
                           moe, RowSpace.of(U), pooled, typical, slots)
    try:
        predicted = np.array([provisional.latency(r.achieved_rate, r.k, r.acceptance_length, r.output_tokens, r.cv,
                                                  r.lifetimes) for r in runs])
    except SpecServeError as e:
        raise SpecServeError(f"latency fit is degenerate ({e}); check the runs' latencies") from None
    return E2EModel(FittedCoefficients.build(names, theta, keep, cis, latency, predicted, cov),
                    moe, RowSpace.of(U), pooled, typical, slots)
