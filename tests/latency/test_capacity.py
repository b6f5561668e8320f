"""Replicas for an SLO (specserve/latency/decisions/capacity.py) and `specserve latency plan --replicas`."""
import json
import math

import pytest

from specserve.cli import main
from specserve.errors import SpecServeError
from specserve.latency.fitting import model_file
from specserve.latency.decisions.capacity import (FIT_MARGIN, Slo, Traffic, capacity_per_replica, per_replica,
                                        plan_capacity, replicas_needed, split_cv)
from specserve.latency.decisions.capacity_report import render
from specserve.latency.equations.lengths import LengthClass


@pytest.fixture(scope="module")
def model(fitted):
    return fitted.model


@pytest.fixture(scope="module")
def model_path(fitted, tmp_path_factory):
    path = tmp_path_factory.mktemp("capacity") / "model.json"
    model_file.save(fitted, path)
    return path


def test_split_cv_of_a_random_split():
    assert split_cv(1.0, 7) == 1.0  # Poisson stays Poisson
    assert split_cv(2.0, 4) == pytest.approx(math.sqrt(1 + 3 / 4))
    assert split_cv(0.0, 1000) == pytest.approx(1.0, abs=1e-3)  # a regular stream split thin looks Poisson


def test_dense_replicas_match_the_closed_form(model):
    """Poisson, the fitted lengths, a mean-E2E SLO T: one replica takes (1 − C1/T)/C2 (formulas.py), so N
    replicas are needed for λ exactly when λ/N is at most that (an SLO whose most is within the fitted rates)."""
    d = model.demands(0, 1.0)
    target = d.c1 / (1 - 0.9 * model.fitted_rate(0) * d.c2)
    most = (1 - d.c1 / target) / d.c2
    assert most == pytest.approx(0.9 * model.fitted_rate(0))
    slo = Slo(e2e=target)
    for rate in (0.5 * most, 1.01 * most, 3.7 * most):
        n, pred = replicas_needed(model, Traffic(rate, cv=1.0), slo, 0, 1.0, 64)
        assert n == math.ceil(rate / most), (rate, most, n)
        assert pred.e2e <= target and pred.rate == pytest.approx(rate / n)
    assert capacity_per_replica(model, Traffic(1.0, cv=1.0), slo, 0, 1.0, 1) == pytest.approx(most, rel=1e-6)


def test_no_count_is_chosen_past_the_fitted_rates(model):
    """A loose SLO that the model says one replica meets far past its fitted runs' highest rate: the
    planner does not extrapolate there; it takes the count that keeps each replica within the fit (x 1.1)
    and marks the others."""
    d = model.demands(0, 1.0)
    fitted = model.fitted_rate(0)
    slo = Slo(e2e=1000 * d.c1)
    rate = 2.5 * fitted
    assert slo.met(per_replica(model, Traffic(rate, cv=1.0), 1, 0, 1.0))  # what extrapolation would answer: 1
    n, pred = replicas_needed(model, Traffic(rate, cv=1.0), slo, 0, 1.0, 64)
    assert n == math.ceil(rate / (FIT_MARGIN * fitted)) and pred.rate <= FIT_MARGIN * fitted
    plan = plan_capacity(model, Traffic(rate, cv=1.0), slo, [0])
    assert [m for m, _ in plan.by_count if plan.beyond_fit(m, 0)] == list(range(1, n))
    assert "? past the fitted runs' highest rate" in render(plan, 1.0)


def test_a_lone_request_missing_the_slo_needs_no_replica_count(model):
    d = model.demands(0, 1.0)
    slo = Slo(e2e=0.5 * d.c1)
    assert replicas_needed(model, Traffic(1.0, cv=1.0), slo, 0, 1.0, 64) == (None, None)
    assert capacity_per_replica(model, Traffic(1.0, cv=1.0), slo, 0, 1.0, 1) == 0.0


def test_every_slo_metric_must_hold(model):
    d = model.demands(0, 1.0)
    loose = Slo(e2e=10 * d.c1)
    lone_ttft = per_replica(model, Traffic(1.0, cv=1.0), 1, 0, 1.0, rate=0.0).ttft
    both = Slo(e2e=10 * d.c1, ttft=1.5 * lone_ttft)
    rate = 2 / d.c2
    n_loose = replicas_needed(model, Traffic(rate, cv=1.0), loose, 0, 1.0, 64)[0]
    n_both, pred = replicas_needed(model, Traffic(rate, cv=1.0), both, 0, 1.0, 64)
    assert n_both >= n_loose and pred.ttft <= 1.5 * lone_ttft


def test_a_length_mix_is_planned_as_the_mixture(model):
    classes = (LengthClass(256, 32, 0.8), LengthClass(256, 512, 0.2))
    t = Traffic(1.0, classes, cv=1.0)
    got = per_replica(model, t, 2, 0, 1.0)
    want = model.predict_classes(0.5, 0, 1.0, classes, 1.0)[0]
    assert got.e2e == pytest.approx(want.e2e)


def test_plan_compares_with_and_without_speculation(model):
    d = model.demands(0, 1.0)
    plan = plan_capacity(model, Traffic(1.5 / d.c2, cv=1.0), Slo(e2e=4 * d.c1), [0, 2, 4])
    assert {o.k for o in plan.options} == {0, 2, 4}
    assert plan.dense.k == 0 and plan.best_speculative.k > 0
    assert plan.best.replicas == min(o.replicas for o in plan.options if o.replicas)
    assert all(o.break_even is not None for o in plan.options if o.k > 0)
    counts = [n for n, _ in plan.by_count]
    assert counts[:plan.best.replicas + 1] == list(range(1, plan.best.replicas + 2))
    assert {o.replicas for o in plan.options} <= set(counts)


def test_bad_inputs_are_one_line_errors(model):
    with pytest.raises(SpecServeError, match="at least one SLO"):
        Slo()
    with pytest.raises(SpecServeError, match="statistic"):
        Slo(e2e=1.0, stat="p50")
    with pytest.raises(SpecServeError, match="rate"):
        plan_capacity(model, Traffic(0.0), Slo(e2e=1.0), [0])


def test_cli_plans_replicas_from_a_trace(model_path, tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(41):  # 40 gaps of 0.5 s: 2 req/s; a skewed mix, 1 long in 5
        rows.append(f"{i * 0.5:.1f},256,{512 if i % 5 == 0 else 32}")
    trace.write_text("\n".join(rows) + "\n")
    args = ["latency", "plan", str(model_path), "--replicas", "--trace", str(trace), "--slo-e2e-ms", "20000",
            "--ks", "0,2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "capacity for 2 req/s" in out and "replica(s) with" in out and "break-even k=2" in out
    assert main(args + ["--json", "--time-scale", "0.5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rate"] == pytest.approx(4.0) and len(data["length_classes"]) == 2
    assert data["replicas_without_speculation"] >= 1 and data["by_replica_count"][0]["replicas"] == 1


def test_cli_needs_a_rate_somewhere(model_path, capsys):
    assert main(["latency", "plan", str(model_path), "--replicas", "--slo-e2e-ms", "1000"]) == 2
    assert "rate" in capsys.readouterr().err
    assert main(["latency", "plan", str(model_path)]) == 2
    assert "--rates is required" in capsys.readouterr().err


def test_a_skewed_mix_of_few_lengths_keeps_each_length():
    from specserve.latency.decisions.capacity_report import mix_classes
    classes = mix_classes([100] * 8 + [300] * 2, [32] * 8 + [512] * 2)
    assert [(c.prompt_tokens, c.output_tokens, c.weight) for c in classes] == [(100, 32, 0.8), (300, 512, 0.2)]
    assert len(mix_classes(range(100), range(1, 101))) == 4  # many lengths: quantile bins
