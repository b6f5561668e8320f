"""Decisions from a fitted model: best k per rate, break-even rates, the most load a latency target
allows, and the bands of rate over which each k is best (docs/design.md §2.3)."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.errors import SpecServeError
from specserve.latency.equations.formulas import BreakEven, break_even, expected_for
from specserve.latency.fitting.model import LatencyModel

AlphaSpec = float | Sequence[float] | None


def acceptance_for(model: LatencyModel, k: int, alpha: AlphaSpec) -> tuple[float, str]:
    """E for draft length k and where it came from: the given α, else the measured configuration with
    this k, else the median α of the measured configurations."""
    if k == 0:
        return 1.0, "no speculation"
    if alpha is not None:
        return expected_for(alpha, k), "given alpha"
    measured = model.configuration(k)
    if measured is not None:
        return measured.acceptance_length, f"measured ({measured.label})"
    typical = model.typical_alpha()
    if typical is None:
        raise SpecServeError(f"no acceptance known for k={k}: pass --alpha")
    return expected_for(typical, k), f"median fitted alpha {typical:.3f}"


def _first_crossing(f, hi: float) -> float | None:
    """Smallest rate in (0, hi) where f changes sign (f continuous until it may become inf at hi)."""
    from scipy.optimize import brentq

    previous, f_prev = 0.0, f(0.0)
    for i in range(1, 257):
        rate = hi * i / 257
        value = f(rate)
        if f_prev == 0.0:
            return previous
        if math.isfinite(value) and (value > 0) != (f_prev > 0):
            return float(brentq(f, previous, rate, xtol=1e-12))
        previous, f_prev = rate, value
    return None


def break_even_for(model: LatencyModel, k: int, expected: float, g: float | None = None,
                   p: float | None = None) -> BreakEven:
    """Closed form for dense-weight models under Poisson arrivals; otherwise (MoE demands that move with
    load, or company that is not λ·L) the numeric crossing of the two latency curves, its dense load
    measured against full-coverage C2."""
    if model.e2e.moe is None and model.arrival_cv == 1.0:
        return break_even(model.demands(0, 1.0, g, p), model.demands(k, expected, g, p))
    dense_sat = model.saturation_rate(0, 1.0, g, p)
    hi = min(dense_sat, model.saturation_rate(k, expected, g, p))
    gap = lambda r: model.latency(r, k, expected, g, p) - model.latency(r, 0, 1.0, g, p)  # noqa: E731
    rate = _first_crossing(gap, hi)
    low_wins = gap(0.0) < 0
    if rate is None:
        return BreakEven("sd-always-wins" if low_wins else "sd-never-wins", None, None)
    return BreakEven("sd-wins-below" if low_wins else "sd-wins-above", rate / dense_sat, rate)


def max_rate_within(model: LatencyModel, k: int, expected: float, target: float) -> float:
    """Largest rate with mean E2E ≤ target (0 if a lone request already misses it)."""
    if not target > 0:
        raise SpecServeError(f"latency target must be > 0 s, got {target!r}")
    if model.e2e.moe is None and model.arrival_cv == 1.0:
        return model.demands(k, expected).max_rate_within(target)
    if model.latency(0.0, k, expected) > target:
        return 0.0
    sat = model.saturation_rate(k, expected)
    return _first_crossing(lambda r: model.latency(r, k, expected) - target, sat) or sat


def measured_ks(model: LatencyModel) -> list[int]:
    """The draft lengths the fitted runs measured (0 only where plain decoding was run)."""
    return sorted({c.k for c in model.configurations})


def outside_measured(model: LatencyModel, ks: Sequence[int]) -> list[int]:
    """Candidates outside [smallest, largest] measured k: their cost per drafted token and their acceptance
    would be extrapolated (the acceptance from the median fitted α), so they are not ranked unless asked."""
    measured = measured_ks(model)
    if not measured:
        return []
    return sorted(k for k in set(ks) if not measured[0] <= k <= measured[-1])


def candidate_ks(model: LatencyModel, ks: Sequence[int], alpha: AlphaSpec = None, extrapolate: bool = True,
                 ) -> tuple[dict[int, float], list[int]]:
    """({k: E} for the candidates the fitted runs can speak for, the candidates left out). A k whose
    costs the runs never separated (say c1d with a single SD configuration) would be ranked on
    coefficients held at 0, so it is not ranked at all; with `extrapolate` false neither is a k outside
    the measured range (outside_measured)."""
    if not extrapolate:
        outside = set(outside_measured(model, ks))
        ks = [k for k in ks if k not in outside]
        if not ks:
            raise SpecServeError(f"no candidate k lies in the measured range {measured_ks(model)}: "
                                 "add one, or allow extrapolation")
    supported, left_out = {}, []
    for k in sorted(set(ks)):
        e = acceptance_for(model, k, alpha)[0]
        if model.estimable("e2e", k, e, model.output_tokens):
            supported[k] = e
        else:
            left_out.append(k)
    if not supported:
        raise SpecServeError(f"the fitted runs cannot identify the latency of any candidate k ({sorted(set(ks))})")
    return supported, left_out


@dataclass(frozen=True, slots=True)
class PlanRow:
    rate: float
    latencies: dict[int, float]  # k -> mean E2E (inf when saturated)
    best_k: int | None  # None: every k saturates
    dense: float | None  # plain decoding at this rate; None when the runs cannot identify it
    meets_target: bool | None  # None without a target
    # The fit's uncertainty carried into the choice (plan(draws=...)): the share of coefficient draws in
    # which each k is best (saturated draws count for none), and the best k's E2E 95% band over the draws.
    best_share: dict[int, float] | None = None
    best_band: tuple[float, float] | None = None

    @property
    def best(self) -> float:
        return math.inf if self.best_k is None else self.latencies[self.best_k]

    @property
    def speedup(self) -> float | None:
        if self.best_k is None or self.dense is None:
            return None
        return math.inf if math.isinf(self.dense) else self.dense / self.best


def _best(lat: dict[int, float]) -> int | None:
    finite = [k for k in lat if math.isfinite(lat[k])]
    return min(finite, key=lambda k: (lat[k], k)) if finite else None


def coefficient_draws(model: LatencyModel, n: int, seed: int = 0) -> tuple[list[LatencyModel], str]:
    """`n` models whose E2E coefficients are drawn from the fit's sampling distribution (normal, with the
    fit's linearised covariance, clipped at 0 as the fit is), and how that distribution was known:
    "covariance", "independent intervals" (a model file without the covariance: its 95% intervals taken
    as independent, which ignores how the coefficients trade off and overstates the spread) or "none"."""
    from dataclasses import replace

    import numpy as np

    c = model.e2e.coefficients
    names = list(c.values)
    mean = np.array([c.values[n_] for n_ in names])
    cov, source = c.covariance_matrix(names), "covariance"
    if cov is None:
        source = "independent intervals"
        sd = [0.0 if c.ci95.get(n_) is None else (c.ci95[n_][1] - c.ci95[n_][0]) / (2 * 1.96) for n_ in names]
        cov = np.diag(np.square(sd))
    if n <= 0 or not np.any(cov):
        return [], "none"
    rng = np.random.default_rng(seed)
    thetas = np.clip(rng.multivariate_normal(mean, cov, size=n, method="eigh", check_valid="ignore"), 0.0, None)
    return [replace(model, e2e=replace(model.e2e, coefficients=replace(c, values=dict(zip(names, map(float, t))))))
            for t in thetas], source


def plan(model: LatencyModel, rates: Sequence[float], ks: Sequence[int], alpha: AlphaSpec = None,
         target: float | None = None, extrapolate: bool = True, draws: int = 0, seed: int = 0) -> list[PlanRow]:
    """Best k at each rate among the identifiable candidates: argmin_k L(λ; k); ties go to the shorter
    draft, which wastes less. `extrapolate` false ranks only k inside the measured range. With `draws`,
    the same choice is made for that many coefficient draws from the fit's uncertainty (coefficient_draws):
    each row then says how often each k came out best and the best k's latency band."""
    import numpy as np

    expected, _ = candidate_ks(model, ks, alpha, extrapolate)
    # plain decoding is a prediction like any k: only within the measured range unless asked
    dense_known = model.estimable("e2e", 0, 1.0, model.output_tokens) and (extrapolate or not outside_measured(model, [0]))
    samples, _ = coefficient_draws(model, draws, seed)
    rows = []
    for rate in rates:
        lat = {k: model.latency(rate, k, e) for k, e in expected.items()}
        best = _best(lat)
        meets = None if target is None else best is not None and lat[best] <= target
        dense = model.latency(rate, 0, 1.0) if dense_known else None
        share = band = None
        if samples:
            counts = dict.fromkeys(expected, 0)
            best_lat = []
            for m in samples:
                drawn = {k: m.latency(rate, k, e) for k, e in expected.items()}
                k_best = _best(drawn)
                if k_best is not None:
                    counts[k_best] += 1
                if best is not None:
                    best_lat.append(drawn[best])
            share = {k: n / len(samples) for k, n in counts.items() if n}
            if best_lat:
                values = np.array(best_lat)
                finite = values[np.isfinite(values)]
                lo = float(np.percentile(finite, 2.5)) if finite.size else math.inf
                # past 2.5 % saturated draws the upper end is no finite number
                hi = float(np.percentile(finite, 97.5)) if finite.size >= 0.975 * values.size else math.inf
                # A coefficient at its bound 0 is drawn on one side only (clipped), so the draws can all lie
                # above the fitted value: the band then reaches down to it, as a highest-density one would.
                band = (min(lo, lat[best]), max(hi, lat[best]))
        rows.append(PlanRow(rate, lat, best, dense, meets, share, band))
    return rows


def best_k_bands(model: LatencyModel, ks: Sequence[int], alpha: AlphaSpec = None,
                 points: int = 400, extrapolate: bool = True) -> list[tuple[int, float, float]]:
    """[(k, from rate, to rate)]: contiguous rate ranges over which k is best, up to the highest rate any
    candidate sustains. Found on a grid, then each boundary solved exactly where the two curves cross."""
    from scipy.optimize import brentq

    ks = list(ks) if extrapolate else [k for k in ks if k not in outside_measured(model, ks)]
    expected, _ = candidate_ks(model, ks, alpha)
    saturation = {k: model.saturation_rate(k, e) for k, e in expected.items()}
    finite = [s for s in saturation.values() if math.isfinite(s)]
    if not finite:  # no contention measured: latency does not depend on rate, one k is best everywhere
        return [(min(expected, key=lambda k: (model.latency(0.0, k, expected[k]), k)), 0.0, math.inf)]
    # With a contention-free candidate among others, look past the others' saturation to see it win.
    top = max(finite) * (2.0 if len(finite) < len(saturation) else 1.0)
    grid = [(row.rate, row.best_k) for row in plan(model, [top * i / points for i in range(points)], list(expected),
                                                   alpha)]
    bands: list[list] = []
    previous_rate = 0.0
    for rate, k in grid:
        if k is None:
            break
        if not bands or bands[-1][0] != k:
            if bands:  # the boundary lies between the last grid rate of one band and the first of the next
                a, b = bands[-1][0], k
                gap = lambda r: model.latency(r, a, expected[a]) - model.latency(r, b, expected[b])  # noqa: E731
                edge = brentq(gap, previous_rate, rate) if gap(previous_rate) * gap(rate) < 0 else rate
                bands[-1][2] = edge
                bands.append([k, edge, top])
            else:
                bands.append([k, rate, top])
        previous_rate = rate
    if bands:
        bands[-1][2] = saturation[bands[-1][0]]  # the last band lasts as long as its k sustains the load
    return [(k, lo, hi) for k, lo, hi in bands]
