"""Least-squares helpers shared by every fitted component: identifiability, non-negative weighted least
squares, confidence intervals, fit quality, and which predictions the data can support."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Relative singular-value cut on column-scaled designs. A column that adds less than 0.1% of a new
# direction (say g/E when g drifts by ±0.1 token around 128 and nothing else varies) would let 0.1% noise
# in latency swing its coefficient by 100%: treat it as not identifiable rather than fit noise.
_RANK_TOL = 1e-3
# A prediction row counts as inside the fitted span when at most 1% of it (column-scaled) lies outside.
_SPAN_TOL = 1e-2


def _scaled(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    scale = np.max(np.abs(X), axis=0)
    scale[scale == 0] = 1.0
    return X / scale, scale


def identifiable_columns(X: np.ndarray) -> list[int]:
    """Indices of columns kept, in order, each adding rank; the others are not identifiable from these
    data (zero, or a combination of earlier columns) and are held at 0."""
    Xs, _ = _scaled(np.asarray(X, dtype=float))
    keep: list[int] = []
    for j in range(Xs.shape[1]):
        trial = Xs[:, keep + [j]]
        s = np.linalg.svd(trial, compute_uv=False)
        if s.size and s[-1] > _RANK_TOL * max(s[0], 1e-300) and np.any(Xs[:, j] != 0):
            keep.append(j)
    return keep


@dataclass(frozen=True, slots=True)
class RowSpace:
    """Rows a linear predictor x·θ is estimable for: x must lie in the row space of the training design."""

    scale: tuple[float, ...]
    basis: tuple[tuple[float, ...], ...]

    @classmethod
    def of(cls, X: np.ndarray) -> "RowSpace":
        Xs, scale = _scaled(np.asarray(X, dtype=float))
        _, s, vt = np.linalg.svd(Xs, full_matrices=False)
        rank = int(np.sum(s > _RANK_TOL * max(s[0], 1e-300))) if s.size else 0
        return cls(tuple(map(float, scale)), tuple(tuple(map(float, row)) for row in vt[:rank]))

    def contains(self, x: Sequence[float], tol: float = _SPAN_TOL) -> bool:
        v = np.asarray(x, dtype=float) / np.asarray(self.scale)
        norm = np.linalg.norm(v)
        if norm == 0:
            return True
        basis = np.asarray(self.basis).reshape(-1, v.size)
        residual = v - basis.T @ (basis @ v)
        return bool(np.linalg.norm(residual) <= tol * norm)


def t_quantile(dof: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, dof))


def covariance(jac: np.ndarray, residuals: np.ndarray, transform: np.ndarray | None = None) -> np.ndarray | None:
    """The linearised covariance s²(JᵀJ)⁻¹ (of T·values with `transform` T: T·cov·Tᵀ); None when there is
    no residual freedom."""
    n, p = jac.shape
    T = np.eye(p) if transform is None else np.asarray(transform, dtype=float)
    if n <= p:
        return None
    s2 = float(residuals @ residuals) / (n - p)
    return T @ (s2 * np.linalg.pinv(jac.T @ jac)) @ T.T


def confidence_intervals(values: np.ndarray, jac: np.ndarray, residuals: np.ndarray,
                         transform: np.ndarray | None = None) -> list[tuple[float, float] | None]:
    """95% intervals from the linearised covariance s²(JᵀJ)⁻¹; None when there is no residual freedom.
    With `transform` T they are the intervals of T·values (covariance T·cov·Tᵀ): the coefficients of a
    fit made in other parameters."""
    n, p = jac.shape
    T = np.eye(p) if transform is None else np.asarray(transform, dtype=float)
    cov = covariance(jac, residuals, T)
    if cov is None:
        return [None] * T.shape[0]
    half = t_quantile(n - p) * np.sqrt(np.clip(np.diag(cov), 0.0, None))
    return [(float(v - h), float(v + h)) for v, h in zip(T @ values, half)]


def nonneg_weighted_lstsq(X: np.ndarray, y: np.ndarray, weights: np.ndarray,
                          ) -> tuple[np.ndarray, list[int], list[tuple[float, float] | None]]:
    """min Σ w²(Xθ − y)² with θ ≥ 0 on the identifiable columns (the rest are 0).

    Returns (θ, kept column indices, CIs of all columns). Costs and demands are physical times, so a
    negative one is never a valid answer; bounding keeps the fit inside the model's domain."""
    from scipy.optimize import lsq_linear

    X, y, w = (np.asarray(a, dtype=float) for a in (X, y, weights))
    keep = identifiable_columns(X)
    theta = np.zeros(X.shape[1])
    cis: list[tuple[float, float] | None] = [None] * X.shape[1]
    if not keep:
        return theta, keep, cis
    A = X[:, keep] * w[:, None]
    res = lsq_linear(A, y * w, bounds=(0.0, np.inf), method="bvls")
    theta[keep] = res.x
    for j, ci in zip(keep, confidence_intervals(res.x, A, A @ res.x - y * w)):
        cis[j] = ci
    return theta, keep, cis


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float:
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    total = float(np.sum((observed - observed.mean()) ** 2))
    residual = float(np.sum((observed - predicted) ** 2))
    return float("nan") if total == 0 else 1.0 - residual / total


def mape(observed: np.ndarray, predicted: np.ndarray) -> float:
    """Mean absolute percentage error, in percent (inf if any prediction is inf)."""
    observed, predicted = np.asarray(observed, float), np.asarray(predicted, float)
    if observed.size == 0:
        return float("nan")
    return float(np.mean(np.abs(predicted - observed) / observed) * 100.0)


# A fitted value this small next to the largest coefficient of its fit sits at its lower bound 0: the
# non-negative fit pushed it there and the data cannot tell it from nothing (the optimiser stops at
# ~1e-15 s, which `explain` used to print as "8.67e-13 ms").
_AT_BOUND = 1e-6


@dataclass(frozen=True, slots=True)
class FittedCoefficients:
    """Named coefficient values with 95% intervals and the quality of the fit they came from."""

    values: dict[str, float]
    ci95: dict[str, tuple[float, float] | None]
    not_identifiable: tuple[str, ...]  # held at 0: the data cannot separate them from the others
    n_points: int
    r2: float
    mape: float  # percent, in-sample
    # Linearised covariance of the values, rows and columns in `values` order (0 for those held at 0);
    # None where the fit leaves no residual freedom, or for files written before it was stored.
    covariance: tuple[tuple[float, ...], ...] | None = None

    def __getitem__(self, name: str) -> float:
        return self.values[name]

    def vector(self, names: Sequence[str]) -> np.ndarray:
        return np.array([self.values[n] for n in names], dtype=float)

    def status(self, name: str) -> str:
        """How far the data speak for one coefficient: "not identifiable" (the runs cannot separate it
        from the others; held at 0), "at bound" (the fit pushed it to its lower bound 0: no cost the data
        can tell from nothing), "unresolved" (positive, but its 95% interval reaches 0) or "resolved"."""
        if name in self.not_identifiable:
            return "not identifiable"
        value = self.values[name]
        largest = max((abs(v) for v in self.values.values()), default=0.0)
        if value <= _AT_BOUND * largest:
            return "at bound"
        ci = self.ci95.get(name)
        if ci is not None and ci[0] <= 0.0:
            return "unresolved"
        return "resolved"

    def covariance_matrix(self, names: Sequence[str]) -> np.ndarray | None:
        """The covariance restricted to `names`, in that order; None when the fit stored none."""
        if self.covariance is None:
            return None
        order = list(self.values)
        idx = [order.index(n) for n in names]
        return np.asarray(self.covariance, dtype=float)[np.ix_(idx, idx)]

    @classmethod
    def build(cls, names: Sequence[str], theta: np.ndarray, keep: Sequence[int],
              cis: Sequence[tuple[float, float] | None], observed: np.ndarray,
              predicted: np.ndarray, cov: np.ndarray | None = None) -> "FittedCoefficients":
        kept = set(keep)
        return cls(values={n: float(v) for n, v in zip(names, theta)},
                   ci95={n: ci for n, ci in zip(names, cis)},
                   not_identifiable=tuple(n for j, n in enumerate(names) if j not in kept),
                   n_points=int(len(observed)), r2=r_squared(observed, predicted),
                   mape=mape(observed, predicted),
                   covariance=None if cov is None else tuple(tuple(map(float, row)) for row in cov))
