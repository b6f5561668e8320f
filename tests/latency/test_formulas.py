"""Every docs/design.md §2 formula against values worked out by hand."""
import math

import pytest

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import (acceptance_length_from_spec, expected_tokens,
                                          expected_tokens_positional, solve_alpha)
from specserve.latency.equations.formulas import (Demands, SpecCoefficients, best_k_at_rate, best_k_under_target,
                                        break_even, dense_latency, speedup, speedup_from_ratios)

COEFS = SpecCoefficients(c1p=0.3, c1v=0.02, c1d=0.004, c2p=0.05, c2v=0.002, c2d=0.002)


def test_expected_tokens_hand_values():
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert expected_tokens(1.0, 4) == 5.0  # α = 1: every draft token kept, E = k + 1
    assert expected_tokens(0.3, 0) == 1.0  # k = 0: plain decoding


def test_positional_acceptance():
    assert expected_tokens_positional([0.8, 0.5]) == pytest.approx(1 + 0.8 + 0.8 * 0.5)
    assert expected_tokens_positional([0.7] * 4) == pytest.approx(expected_tokens(0.7, 4))
    assert expected_tokens_positional([0.9, 0.0, 0.9]) == pytest.approx(1.9)  # a dead position ends the run
    with pytest.raises(SpecServeError):
        expected_tokens_positional([0.5, 1.2])


def test_solve_alpha_inverts_expected_tokens():
    for alpha, k in [(0.3, 1), (0.75, 4), (0.95, 8)]:
        assert solve_alpha(expected_tokens(alpha, k), k) == pytest.approx(alpha, abs=1e-9)
    assert solve_alpha(5.0, 4) == 1.0
    with pytest.raises(SpecServeError):
        solve_alpha(6.0, 4)  # more than k + 1 tokens per cycle is impossible


def test_acceptance_length_from_spec_fields():
    assert acceptance_length_from_spec({"mean_acceptance_length": 2.5}, 4) == 2.5
    assert acceptance_length_from_spec({"num_drafts": 10, "num_accepted_tokens": 15}, 4) == 2.5
    assert acceptance_length_from_spec({"acceptance_rate": 0.5}, 4) == 3.0
    assert acceptance_length_from_spec(None, 4) is None
    with pytest.raises(SpecServeError):
        acceptance_length_from_spec({"mean_acceptance_length": 0.5}, 4)


def test_dense_latency_and_saturation():
    assert dense_latency(2.0, 2.0, 0.25) == pytest.approx(4.0)  # 2 / (1 − 0.5)
    assert dense_latency(0.0, 2.0, 0.25) == 2.0
    assert Demands(2.0, 0.25).saturation_rate == 4.0
    assert math.isinf(dense_latency(4.0, 2.0, 0.25))  # λ·C2 = 1
    assert math.isinf(dense_latency(10.0, 2.0, 0.25))  # beyond: inf, not a negative latency


def test_six_coefficient_demands_by_hand():
    d = COEFS.demands(128, 2.0, 4)
    assert d.c1 == pytest.approx(0.3 + 64 * (0.02 + 4 * 0.004))
    assert d.c2 == pytest.approx(0.05 + 64 * (0.002 + 4 * 0.002))
    dense = COEFS.dense(128)
    assert (dense.c1, dense.c2) == pytest.approx((0.3 + 128 * 0.02, 0.05 + 128 * 0.002))
    assert COEFS.demands(128, 1.0, 0) == dense  # k = 0 is the dense baseline


def test_alpha_one_gives_k_plus_one_cycles_saved():
    d = COEFS.demands(120, expected_tokens(1.0, 5), 5)
    assert d.c1 == pytest.approx(0.3 + 20 * (0.02 + 5 * 0.004))


def test_speedup_at_zero_load_is_inverse_c1r():
    dense, sd = COEFS.dense(128), COEFS.demands(128, expected_tokens(0.7, 4), 4)
    assert speedup(0.0, dense, sd) == pytest.approx(dense.c1 / sd.c1)
    assert speedup_from_ratios(sd.c1 / dense.c1, sd.c2 / dense.c2, 0.0) == pytest.approx(dense.c1 / sd.c1)


def test_speedup_closed_form_matches_latency_ratio():
    dense, sd = COEFS.dense(128), COEFS.demands(128, expected_tokens(0.7, 4), 4)
    c1r, c2r = sd.c1 / dense.c1, sd.c2 / dense.c2
    for r in (0.1, 0.3, 0.5):
        rate = r / dense.c2
        assert speedup_from_ratios(c1r, c2r, r) == pytest.approx(speedup(rate, dense, sd))


def test_break_even_by_hand():
    dense, sd = Demands(2.0, 0.25), Demands(1.0, 0.5)  # C1R = 0.5, C2R = 2
    be = break_even(dense, sd)
    assert be.regime == "sd-wins-below"
    assert be.dense_load == pytest.approx((0.5 - 1) / (0.5 - 2))  # 1/3
    assert be.rate == pytest.approx(1 / 3 / 0.25)
    assert speedup(be.rate, dense, sd) == pytest.approx(1.0)
    assert speedup(0.9 * be.rate, dense, sd) > 1 > speedup(1.1 * be.rate, dense, sd)


def test_break_even_regimes():
    assert break_even(Demands(2, 0.25), Demands(1, 0.2)).regime == "sd-always-wins"
    assert break_even(Demands(2, 0.25), Demands(3, 0.3)).regime == "sd-never-wins"
    assert break_even(Demands(2, 0.25), Demands(3, 0.2)).regime == "sd-wins-above"
    assert break_even(Demands(2, 0.25), Demands(2, 0.25)).regime == "identical"
    assert break_even(Demands(2, 0.25), Demands(2, 0.3)).regime == "sd-never-wins"  # tie at zero load


def test_best_k_at_rate_and_under_target():
    ks = range(0, 9)
    k_low, lat_low = best_k_at_rate(COEFS, 0.01, 128, 0.9, ks)
    k_high, _ = best_k_at_rate(COEFS, 3.0, 128, 0.9, ks)
    assert k_low > k_high  # long drafts at low load, short or none at high load (docs/design.md §2.3)
    brute = min(COEFS.demands(128, expected_tokens(0.9, k) if k else 1.0, k).latency(0.01) for k in ks)
    assert lat_low == pytest.approx(brute)
    k, rate = best_k_under_target(COEFS, 5.0, 128, 0.9, ks)
    d = COEFS.demands(128, expected_tokens(0.9, k) if k else 1.0, k)
    assert d.latency(rate) == pytest.approx(5.0)
    assert rate == pytest.approx((1 - d.c1 / 5.0) / d.c2)
    with pytest.raises(SpecServeError):
        best_k_under_target(COEFS, 0.1, 128, 0.9, ks)  # no k serves even a lone request in 100 ms
    with pytest.raises(SpecServeError):
        best_k_at_rate(COEFS, 100.0, 128, 0.9, ks)  # every k saturated


@pytest.mark.parametrize("alpha", [0.0, -0.1, 1.2, float("nan")])
def test_alpha_outside_unit_interval_is_an_error(alpha):
    with pytest.raises(SpecServeError, match="alpha"):
        expected_tokens(alpha, 3)


@pytest.mark.parametrize("kwargs", [dict(c1p=-0.1), dict(c2d=-1e-3), dict(c1v=float("inf"))])
def test_negative_or_infinite_coefficients_are_errors(kwargs):
    values = dict(c1p=0.3, c1v=0.02, c1d=0.004, c2p=0.05, c2v=0.002, c2d=0.002) | kwargs
    with pytest.raises(SpecServeError, match="coefficient"):
        SpecCoefficients(**values)


def test_other_bad_inputs():
    with pytest.raises(SpecServeError):
        Demands(0.0, 0.1)  # a request cannot take no time alone
    with pytest.raises(SpecServeError):
        Demands(1.0, 0.1).latency(-1.0)
    with pytest.raises(SpecServeError):
        expected_tokens(0.5, -1)
    with pytest.raises(SpecServeError):
        COEFS.demands(128, 6.0, 4)  # E beyond k + 1
    with pytest.raises(SpecServeError):
        speedup(10.0, Demands(1, 0.5), Demands(1, 0.6))  # both saturated: undefined, not 1 or 0
    with pytest.raises(SpecServeError):
        speedup_from_ratios(0.5, 2.0, 1.0)
