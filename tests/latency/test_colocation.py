"""The co-location term (specserve/latency/fitting/colocation.py) and the capacity planner using it."""
import json

import pytest

from specserve.cli import main
from specserve.errors import SpecServeError
from specserve.latency.decisions.capacity import Slo, Traffic, per_replica, plan_capacity
from specserve.latency.decisions.capacity_report import render, to_json
from specserve.latency.equations.lengths import LengthClass
from specserve.latency.fitting import model_file
from specserve.latency.fitting.colocation import (Colocation, Observation, Slowdown, fit_colocation, predicted_e2e,
                                                  scaled)

MIX = (LengthClass(64.0, 8.0, 0.8), LengthClass(64.0, 64.0, 0.2))


@pytest.fixture(scope="module")
def model(fitted):
    return fitted.model


def synthetic(model, replicas: int, s1: float, s2: float, rates, cv: float = 1.0) -> list[Observation]:
    """Runs measured on a deployment whose replicas are exactly the fit with C1 x s1, C2 x s2."""
    obs = []
    for rate in rates:
        o = Observation(replicas, rate, cv, MIX, 1.0)
        obs.append(Observation(replicas, rate, cv, MIX, predicted_e2e(model, o, s1, s2)))
    return obs


def test_scaled_model_scales_the_lone_request_and_the_load(model):
    lone = model.predict(0.0, 0, 1.0).e2e
    assert scaled(model, 1.3, 1.0).predict(0.0, 0, 1.0).e2e == pytest.approx(1.3 * lone)
    d = model.demands(0, 1.0)
    slow = scaled(model, 1.0, 1.5).demands(0, 1.0)
    assert (slow.c1, slow.c2) == pytest.approx((d.c1, 1.5 * d.c2))
    base, load = model.parts("ttft", 0.3 * model.fitted_rate(0), 0, 1.0)
    assert scaled(model, 2.0, 1.0).parts("ttft", 0.0, 0, 1.0)[0] == pytest.approx(2.0 * base)
    assert scaled(model, 1.0, 1.0) is model


def test_fit_recovers_known_factors(model):
    top = model.fitted_rate(0)
    runs = (synthetic(model, 1, 0.95, 0.9, [0.3 * top, 0.6 * top, 0.9 * top], cv=0.9)
            + synthetic(model, 2, 1.1, 1.4, [0.6 * top, 1.0 * top, 1.4 * top], cv=1.1))
    colo = fit_colocation(model, runs)
    assert [s.replicas for s in colo.slowdowns] == [1, 2]
    assert colo.factors(1) == pytest.approx((0.95, 0.9), rel=1e-3)
    assert colo.factors(2) == pytest.approx((1.1, 1.4), rel=1e-3)
    assert all(s.mape < 0.1 for s in colo.slowdowns)


def test_runs_at_one_rate_give_one_shared_factor(model):
    runs = synthetic(model, 2, 1.2, 1.2, [0.8 * model.fitted_rate(0)] * 3)
    s1, s2 = fit_colocation(model, runs).factors(2)
    assert s1 == s2 == pytest.approx(1.2, rel=1e-3)


def test_planner_uses_the_term_and_flags_counts_beyond_the_measured(model):
    colo = Colocation((Slowdown(1, 1.0, 1.0, 3, 0.0), Slowdown(2, 1.0, 1.5, 3, 0.0)))
    top = model.fitted_rate(0)
    traffic = Traffic(2.0 * top, MIX, 1.0)
    slo = Slo(e2e=per_replica(model, traffic, 1, 0, 1.0, rate=0.5 * top).e2e * 1.001)  # independent copies: 4
    plain, colocated = (plan_capacity(model, traffic, slo, [0], max_replicas=16, colocation=c) for c in (None, colo))
    assert plain.dense.replicas == 4 and colocated.dense.replicas > 4  # slower replicas: more of them
    assert colocated.dense.replicas > colo.measured and colocated.beyond_measured(colocated.dense.replicas)
    assert not plain.beyond_measured(colocated.dense.replicas)  # no term: nothing to be beyond
    two = dict(colocated.by_count)[2][0]
    assert two.e2e == pytest.approx(per_replica(scaled(model, 1.0, 1.5), traffic, 2, 0, 1.0).e2e)
    text = render(colocated, 1.0)
    assert "more replicas than the 2 measured together" in text and "*?" in text
    rows = {r["replicas"]: r for r in to_json(colocated, 1.0)["by_replica_count"]}
    assert rows[2]["beyond_measured_replicas"] is False and rows[3]["beyond_measured_replicas"] is True


def test_a_count_between_measured_ones_takes_the_largest_below():
    colo = Colocation((Slowdown(1, 1.0, 1.0, 3, 0.0), Slowdown(4, 1.1, 1.3, 3, 0.0)))
    assert colo.factors(3) == (1.0, 1.0) and colo.factors(9) == (1.1, 1.3) and colo.beyond(5)
    with pytest.raises(SpecServeError):
        Colocation(())


def test_old_model_file_plans_as_before_and_the_term_round_trips(fitted, tmp_path, capsys):
    path = tmp_path / "model.json"
    model_file.save(fitted, path)
    assert model_file.load_colocation(path) is None
    rate, slo = 1.5 * fitted.model.fitted_rate(0), Slo(e2e=1.5 * fitted.model.predict(0.0, 0, 1.0).e2e)
    args = ["latency", "plan", str(path), "--replicas", "8", "--rates", str(rate), "--slo-e2e-ms",
            str(slo.e2e * 1e3), "--ks", "0", "--json"]
    assert main(args) == 0
    before = json.loads(capsys.readouterr().out)
    expected = plan_capacity(fitted.model, Traffic(rate), slo, [0], max_replicas=8)
    assert before["best"]["replicas"] == expected.best.replicas >= 2 and before["colocation"] is None
    assert [r["e2e_s_by_k"]["0"] for r in before["by_replica_count"]] == pytest.approx(
        [p[0].e2e for _, p in expected.by_count])

    colo = Colocation((Slowdown(1, 1.0, 1.0, 3, 1.0), Slowdown(2, 1.1, 1.6, 6, 2.0)))
    model_file.save_colocation(path, colo)
    assert model_file.load_colocation(path) == colo
    assert model_file.load(path).model.output_tokens == fitted.model.output_tokens  # still a model file
    assert main(args) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["colocation"]["slowdowns"][1]["c2"] == 1.6
    rows = {r["replicas"]: r["e2e_s_by_k"]["0"] for r in after["by_replica_count"]}
    old = {r["replicas"]: r["e2e_s_by_k"]["0"] for r in before["by_replica_count"]}
    assert rows[1] == pytest.approx(old[1]) and rows[2] > old[2]
