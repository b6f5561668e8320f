"""MoE coverage φ(T) and the implicit latency solve."""
import math

import pytest

from specserve.errors import SpecServeError
from specserve.latency.equations.formulas import Demands
from specserve.latency.equations.moe import MoeDemands, MoeExperts, moe_latency, routed_tokens

EXPERTS = MoeExperts(8, 128)
SPLIT = MoeDemands(c1u=1.0, c1s=1.5, c2u=0.05, c2s=0.2)


def test_coverage_by_hand():
    assert EXPERTS.coverage(1) == pytest.approx(8 / 128)
    assert EXPERTS.coverage(2) == pytest.approx(1 - (120 / 128) ** 2)
    assert EXPERTS.coverage(0) == 0.0
    assert MoeExperts(4, 4).coverage(1) == 1.0
    assert routed_tokens(0.2, 5) == 5  # a lone request still routes its own k + 1 tokens
    assert routed_tokens(3.0, 5) == 15


def test_solution_satisfies_the_fixed_point():
    for rate, k in [(0.5, 0), (1.5, 4), (3.0, 2)]:
        latency = moe_latency(rate, SPLIT, EXPERTS, k + 1)
        phi = EXPERTS.coverage(routed_tokens(rate * latency, k + 1))
        d = SPLIT.at(phi)
        assert latency == pytest.approx(d.c1 / (1 - rate * d.c2), rel=1e-9)


@pytest.mark.parametrize("cv", [0.25, 2.0])
def test_solution_satisfies_the_fixed_point_with_non_poisson_arrivals(cv):
    from specserve.latency.equations.arrival_regularity import company

    for rate, k in [(0.5, 0), (1.5, 4), (3.0, 2)]:
        latency = moe_latency(rate, SPLIT, EXPERTS, k + 1, cv)
        d = SPLIT.at(EXPERTS.coverage(routed_tokens(rate * latency, k + 1)))
        assert latency == pytest.approx(d.c1 + d.c2 * float(company(rate * latency, cv)), rel=1e-9)
        poisson = moe_latency(rate, SPLIT, EXPERTS, k + 1)
        assert (latency < poisson) if cv < 1 else (latency > poisson)


def test_full_coverage_reduces_to_the_closed_form():
    dense = MoeExperts(16, 16)  # every token touches every expert: φ = 1 always
    assert moe_latency(2.0, SPLIT, dense, 1) == pytest.approx(Demands(2.5, 0.25).latency(2.0))
    no_experts = MoeDemands(2.0, 0.0, 0.25, 0.0)
    assert moe_latency(2.0, no_experts, EXPERTS, 1) == pytest.approx(Demands(2.0, 0.25).latency(2.0))


def test_latency_rises_with_rate_between_partial_and_full_coverage():
    lats = [moe_latency(r, SPLIT, EXPERTS, 1) for r in (0.0, 0.5, 1.0, 2.0, 3.5)]
    assert lats == sorted(lats)
    assert lats[0] == pytest.approx(SPLIT.at(EXPERTS.coverage(1)).c1)
    for rate, lat in zip((0.5, 1.0, 2.0, 3.5), lats[1:]):
        # Below one request in flight the coverage is a lone request's (B is floored at 1).
        assert SPLIT.at(EXPERTS.coverage(1)).latency(rate) <= lat < SPLIT.full.latency(rate)
    assert lats[-1] > SPLIT.at(EXPERTS.coverage(1)).latency(3.5) * 1.5


def test_saturation_at_full_coverage_is_inf():
    assert math.isinf(moe_latency(1 / 0.25, SPLIT, EXPERTS, 1))
    assert math.isinf(moe_latency(10.0, SPLIT, EXPERTS, 1))


def test_bad_moe_inputs():
    with pytest.raises(SpecServeError):
        MoeExperts(0, 8)
    with pytest.raises(SpecServeError):
        MoeExperts(9, 8)
    with pytest.raises(SpecServeError):
        MoeDemands(1.0, -0.1, 0.1, 0.1)
    with pytest.raises(SpecServeError):
        moe_latency(1.0, SPLIT, EXPERTS, 0.5)
    with pytest.raises(SpecServeError):
        moe_latency(-1.0, SPLIT, EXPERTS, 1)
