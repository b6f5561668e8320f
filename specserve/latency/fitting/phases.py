"""TTFT and TPOT models: each a load-independent part plus a part that grows with the number in flight B.

A step of the engine carries every running request's decode (or draft-and-verify cycle) together with any
new prompt's prefill chunk; a request's first speculative step also runs the draft over the whole prompt
(the draft's cache is not shared with the target's prefix cache): its catch-up, D seconds, measured from the
per-request rows as the first inter-token gap minus the later ones (fit.py).

    TPOT(λ) = [(s1v + k·s1d) + company(B)·(s2v + k·s2d)] / E + [k>0]·D·(1 + B)/(g − 1)
        a cycle costs one verify pass plus k draft steps (s1v, s1d, host time included); each request in
        flight adds its own verify and draft work (and, once, its prefill chunk) to the shared step (s2v,
        s2d) — company(B) of them over a request's lifetime (B for Poisson); a cycle commits E tokens. A
        request's g − 1 later tokens also wait for its own catch-up step and for the B that arrive during
        its lifetime (λ·L = B arrivals, whatever the arrival regularity): D each, not fitted.

    TTFT(λ) = t1 + tw·P_busy(B)·cycle(k, E, B) + tc·λ·[k>0]·D²/2
        t1: a lone request's time to first token (host time: HTTP, tokenizing, scheduling, and its prefill
        step); tw: the steps' worth a new prompt waits when the batch is busy (P_busy(B), 1 − e^(−B) for
        Poisson): the rest of the step in progress plus the others' share of the step its prefill joins,
        in units of the fitted cycle (s1v + k·s1d) + company(B)·(s2v + k·s2d), so a configuration's TTFT
        load follows from its cycle, which every run measures; tc: with SD the step in progress is a
        catch-up of length D for a fraction λ·D of the time, where an arrival waits D/2 more (tc ≈ 1 if that
        were all; our server fits 7-8 on two machines, a mechanism not yet found: docs/latency.md).

The mean TPOT a model predicts is not this one but (E2E − TTFT)/(g − 1) (model.py): the TPOT model is the
cycle TTFT's wait term reads, and from speculative runs alone it cannot tell plain decoding's cycle from a
speculative cycle with no drafts (docs/latency.md).

B(λ) = λ·L(λ) comes from the E2E model (Little's law), so all three metrics share one notion of load;
P_busy and company turn it into what a request meets under the runs' arrival regularity (arrivals.py).
The coefficients are fitted by non-negative least squares of the measured means on the measured
B̂ = λ·L (relative residuals), TPOT first, since TTFT's load term uses its cycle.

Model files written before these terms hold TTFT as t1 + [k>0]·t1d + P_busy(B)·(tb + k·tb_d) +
M(B)·(t2 + k·t2d) (`LEGACY_TTFT`); they are still read and predict as they did.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import busy_on_arrival, company, seen_on_arrival
from specserve.latency.fitting.regression import FittedCoefficients, RowSpace, nonneg_weighted_lstsq
from specserve.latency.records.runs import BenchRun

NAMES = {"ttft": ("t1", "tw", "tc"), "tpot": ("s1v", "s1d", "s2v", "s2d")}
LEGACY_TTFT = ("t1", "t1d", "tb", "tb_d", "t2", "t2d")


@dataclass(frozen=True, slots=True)
class Point:
    """What a phase model needs to know about the point it predicts."""

    k: int
    expected: float  # E
    in_flight: float  # B = λ·L
    rate: float  # λ
    output_tokens: float  # g
    cv: float = 1.0
    catch_up: float = 0.0  # D, seconds (0 without SD or unmeasured)
    cycle: float = 0.0  # seconds per cycle at this load (TTFT's load term; from the TPOT model)


def _spec(k: int) -> float:
    return 1.0 if k > 0 else 0.0


def features(names: Sequence[str], p: Point) -> np.ndarray:
    """One row of the design: each coefficient's multiplier at point p."""
    if names == NAMES["ttft"]:
        return np.array([1.0, float(busy_on_arrival(p.in_flight, p.cv)) * p.cycle,
                         p.rate * _spec(p.k) * p.catch_up ** 2 / 2])
    if names == LEGACY_TTFT:
        busy, seen = float(busy_on_arrival(p.in_flight, p.cv)), float(seen_on_arrival(p.in_flight, p.cv))
        return np.array([1.0, _spec(p.k), busy, busy * p.k, seen, seen * p.k])
    shape = np.array([1.0, p.k]) / p.expected
    return np.concatenate([shape, float(company(p.in_flight, p.cv)) * shape])


def shapes(names: Sequence[str], k: int, expected: float) -> tuple[np.ndarray, np.ndarray]:
    """How a configuration scales the lone and the load terms (load left aside): what the fitted runs must
    span for a prediction at (k, E) to rest on identified coefficients (TTFT's are told apart by load)."""
    if names == NAMES["ttft"]:
        return np.array([1.0]), np.array([1.0, _spec(k)])
    if names == LEGACY_TTFT:
        return np.array([1.0, _spec(k)]), np.array([1.0, float(k)])
    shape = np.array([1.0, k]) / expected
    return shape, shape


def catch_up_per_token(p: Point) -> float:
    """TPOT's share of the catch-up steps a request waits for: its own and those of the B arriving during
    its lifetime, spread over its g − 1 later tokens."""
    if p.k == 0 or p.catch_up <= 0 or p.output_tokens <= 1:
        return 0.0
    return p.catch_up * (1.0 + p.in_flight) / (p.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class PhaseModel:
    metric: str  # "ttft" or "tpot"
    coefficients: FittedCoefficients
    base_space: RowSpace
    load_space: RowSpace

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.coefficients.values)

    def parts(self, p: Point) -> tuple[float, float]:
        """TTFT model only: (load-independent seconds, seconds added by the B requests in flight). The TPOT
        model gives TTFT its cycle; TPOT itself is predicted as (E2E − TTFT)/(g − 1) (LatencyModel.parts)."""
        x = features(self.names, p) * self.coefficients.vector(self.names)
        split = 2 if self.names == LEGACY_TTFT else 1
        return float(x[:split].sum()), float(x[split:].sum())

    def cycle(self, k: int, in_flight: float, cv: float = 1.0) -> float:
        """TPOT model only: seconds one cycle of a request takes at load B (its E tokens' worth)."""
        return float(features(self.names, Point(k, 1.0, in_flight, 0.0, 0.0, cv)) @ self.coefficients.vector(self.names))

    def estimable(self, k: int, expected: float) -> bool:
        if self.names == NAMES["ttft"]:  # its columns vary apart (cycle, λ·D²): each identified or not
            used = ("t1", "tw", "tc") if k > 0 else ("t1", "tw")
            return not set(used) & set(self.coefficients.not_identifiable)
        base, load = shapes(self.names, k, expected)
        return self.base_space.contains(base) and self.load_space.contains(load)


def fit_phase(metric: str, runs: Sequence[BenchRun], points: Sequence[Point],
              known: Sequence[float] | None = None) -> PhaseModel:
    """Fit one metric's coefficients to the runs' means, each run described by its `Point`. Parts the
    coefficients do not stand for are taken off the observations first: TPOT's fixed catch-up share, and
    `known` seconds per run (TTFT's wait for a slot, model.py)."""
    if metric not in NAMES:
        raise SpecServeError(f"unknown phase metric {metric!r}")
    if len(runs) < 2:
        raise SpecServeError(f"need at least 2 runs to fit {metric.upper()}, got {len(runs)}")
    names = NAMES[metric]
    observed = np.array([getattr(r, metric).mean for r in runs])
    fixed = np.array([catch_up_per_token(p) if metric == "tpot" else 0.0 for p in points])
    if known is not None:
        fixed = fixed + np.asarray(known, dtype=float)
    X = np.array([features(names, p) for p in points])
    theta, keep, cis = nonneg_weighted_lstsq(X, observed - fixed, 1.0 / observed)
    coefficients = FittedCoefficients.build(names, theta, keep, cis, observed, X @ theta + fixed)
    pairs = [shapes(names, p.k, p.expected) for p in points]
    return PhaseModel(metric, coefficients, RowSpace.of(np.array([b for b, _ in pairs])),
                      RowSpace.of(np.array([s for _, s in pairs])))
