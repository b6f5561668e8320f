"""Arrival regularity: the company formulas against simulated arrivals, and the latency fixed point."""
import numpy as np
import pytest

from specserve.errors import SpecServeError
from specserve.latency.equations.arrival_regularity import (EQUAL, Lifetimes, busy_on_arrival, check_cv, company, loaded_latency,
                                        run_cv, seen_on_arrival)


def _simulate(cv: float, lifetime: float, n: int = 200_000, seed: int = 0) -> tuple[float, float, float]:
    """Unit-rate Gamma arrivals, every request in flight for `lifetime`: (mean company over a lifetime,
    mean number found in flight on arrival, fraction of arrivals that find anyone)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.gamma(1 / cv**2, cv**2, n))
    before = np.arange(n) - np.searchsorted(t, t - lifetime, side="right")  # arrivals in (t − L, t)
    # Over its lifetime a request shares the server with another that arrived d apart for L − |d|:
    # sum that over the pairs (each counts for both requests) and average per request.
    shared, lag = 0.0, 1
    while True:
        overlap = np.clip(lifetime - (t[lag:] - t[:-lag]), 0.0, None)
        if not overlap.any():
            break
        shared, lag = shared + 2 * overlap.sum(), lag + 1
    return shared / lifetime / n, before.mean(), (before > 0).mean()


@pytest.mark.parametrize("cv,lifetime", [(0.25, 0.6), (0.25, 1.5), (0.25, 6.0), (0.5, 3.0), (2.0, 0.8), (2.0, 5.0)])
def test_formulas_match_simulated_gamma_arrivals(cv, lifetime):
    simulated = _simulate(cv, lifetime)
    modelled = (company(lifetime, cv), seen_on_arrival(lifetime, cv), busy_on_arrival(lifetime, cv))
    for name, sim, mod in zip(("company", "seen on arrival", "busy on arrival"), simulated, modelled):
        assert abs(sim - mod) < 0.02 * max(1.0, sim), (name, sim, float(mod))


def test_poisson_is_spec_load_and_the_tables_agree_near_it():
    x = np.array([0.0, 0.3, 1.0, 4.0, 30.0, 100.0])
    assert np.allclose(company(x, 1.0), x) and np.allclose(seen_on_arrival(x, 1.0), x)
    assert np.allclose(busy_on_arrival(x, 1.0), 1 - np.exp(-x))
    # the Gamma tables (cv ≠ 1) tend to the same: shape 1/cv² = 1.02 is nearly exponential
    assert np.allclose(company(x, 0.99), x, atol=0.03) and np.allclose(seen_on_arrival(x, 0.99), x, atol=0.03)


@pytest.mark.parametrize("cv", [0.1, 0.25, 2.0])
def test_high_load_asymptote_is_x_plus_cv2_minus_1(cv):
    for x in (50.0, 63.0, 90.0, 500.0):  # inside and beyond the table (company's offset decays as 1/x)
        assert float(company(x, cv)) == pytest.approx(x + cv**2 - 1, abs=3.0 / x)
        assert float(seen_on_arrival(x, cv)) == pytest.approx(x + (cv**2 - 1) / 2, abs=0.02)


def test_regular_arrivals_leave_a_short_request_alone():
    assert float(company(0.5, 0.1)) < 1e-3 and float(busy_on_arrival(0.5, 0.1)) < 1e-3
    assert float(company(0.5, 2.0)) > 0.5  # bursty ones crowd it


@pytest.mark.parametrize("cv", [0.05, 0.25, 1.0, 2.0, 4.0])
def test_loaded_latency_is_the_smallest_fixed_point(cv):
    c1, c2 = 3.0, 0.4
    rates = np.array([0.0, 0.05, 0.5, 1.5, 2.4])
    got = loaded_latency(c1, c2, rates, cv)
    assert np.allclose(c1 + c2 * company(rates * got, cv), got, rtol=1e-9)
    for rate, latency in zip(rates, got):  # no smaller root: the right side stays above L below it
        grid = np.linspace(c1, latency, 2000)[:-1]
        assert np.all(c1 + c2 * company(rate * grid, cv) >= grid - 1e-9)
    if cv == 1.0:
        assert np.allclose(got, c1 / (1 - rates * c2))
    assert loaded_latency(c1, c2, 2.5, cv) == np.inf and loaded_latency(c1, c2, 3.0, cv) == np.inf


def test_regularity_moves_latency_the_right_way():
    poisson, regular, bursty = (float(loaded_latency(3.0, 0.4, 1.0, cv)) for cv in (1.0, 0.25, 2.0))
    assert regular < poisson < bursty


def test_cv_outside_the_modelled_range_is_an_error():
    for bad in (0.0, -1.0, 0.01, 5.0, float("nan")):
        with pytest.raises(SpecServeError, match="arrival CV"):
            check_cv(bad)
    with pytest.raises(SpecServeError, match="arrival CV"):
        run_cv("gamma", 10.0)
    assert run_cv("poisson", None) == 1.0 and run_cv("gamma", 0.25) == 0.25
    assert run_cv("trace", None) is None and run_cv("closed", None) is None


def test_the_cv_the_requests_met_comes_before_the_processs():
    """A record's `arrival_gap_cv` (its measured requests' gaps) is the CV the load term uses, kept within
    the modelled range; without it, the process's."""
    assert run_cv("trace", None, 0.7) == 0.7 and run_cv("poisson", None, 1.3) == 1.3
    assert run_cv("gamma", 0.25, 9.0) == 4.0 and run_cv("gamma", 0.25, 0.01) == 0.05
    assert run_cv("gamma", 0.25, None) == 0.25 and run_cv("poisson", None, float("nan")) == 1.0


def _simulate_mixed(cv: float, lifetimes: np.ndarray, n: int = 100_000, seed: int = 1) -> float:
    """Unit-rate Gamma arrivals, each request's lifetime drawn from `lifetimes`: the lifetime-weighted
    company, Σ_i (time others spend beside i) / Σ_i ℓ_i."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.gamma(1 / cv**2, cv**2, n))
    life = rng.choice(lifetimes, n)
    shared, lag = 0.0, 1
    while True:  # pair (i, i + lag): the later one's span cut by the earlier one's end
        start = t[lag:]
        overlap = np.clip(np.minimum(t[:-lag] + life[:-lag], start + life[lag:]) - start, 0.0, None)
        if not overlap.any():  # arrivals lag apart outlive every lifetime: so do all further lags
            break
        shared, lag = shared + 2 * overlap.sum(), lag + 1
    return shared / life.sum()


@pytest.mark.parametrize("cv,mean_life", [(0.25, 0.8), (0.25, 3.0), (0.5, 6.0), (2.0, 2.0)])
def test_mixed_lifetimes_match_simulated_arrivals(cv, mean_life):
    shapes = np.array([0.1, 0.4, 1.0, 2.5])  # short and long requests, equally many
    life = shapes / shapes.mean() * mean_life
    simulated = _simulate_mixed(cv, life)
    modelled = float(company(mean_life, cv, Lifetimes.of(life)))
    assert abs(simulated - modelled) < 0.02 * max(1.0, simulated), (simulated, modelled)
    if cv < 1:  # a mix keeps less of the regular-arrival discount than equal lifetimes do
        assert float(company(mean_life, cv)) < modelled < mean_life


def test_mixed_lifetimes_reduce_to_the_plain_formulas():
    x = np.array([0.0, 0.4, 1.0, 3.0, 20.0, 64.0, 200.0])
    mix = Lifetimes.of([30, 64, 128, 512, 700])
    assert np.allclose(company(x, 1.0, mix), x)                       # Poisson: x for any mix
    assert Lifetimes.of([128, 128, 129]) is EQUAL                     # within 2 %: one length
    assert np.allclose(company(x, 0.5, Lifetimes.of([100, 200], [0.5, 0.5])),
                       company(x, 0.5, Lifetimes.of([100, 200, 200, 100])))  # classes or requests alike
    r, w = np.array(mix.values), np.array(mix.weights)
    share = sum(w[i] * w[j] * min(r[i], r[j]) for i in range(len(r)) for j in range(len(r)))
    for big in (50.0, 90.0, 500.0):  # x − (1 − c²)·Σ w_i w_j min(r_i, r_j) at high load, in and past the table
        assert float(company(big, 0.5, mix)) == pytest.approx(big - 0.75 * share, abs=3.0 / big)


def test_loaded_latency_takes_one_lifetime_mix_per_element():
    mix = Lifetimes.of([20, 100, 400])
    got = loaded_latency([3.0, 3.0], [0.4, 0.4], [1.5, 1.5], 0.25, [EQUAL, mix])
    assert got[0] == pytest.approx(float(loaded_latency(3.0, 0.4, 1.5, 0.25)))
    assert got[1] == pytest.approx(3.0 + 0.4 * float(company(1.5 * got[1], 0.25, mix)), rel=1e-9)
    assert got[0] < got[1] < 3.0 / (1 - 1.5 * 0.4)  # between equal lifetimes and Poisson
    with pytest.raises(SpecServeError, match="one Lifetimes per element"):
        loaded_latency([3.0, 3.0], 0.4, 1.0, 0.25, [mix])
    for bad in ([], [1.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(SpecServeError, match="lifetimes"):
            Lifetimes.of(bad)
