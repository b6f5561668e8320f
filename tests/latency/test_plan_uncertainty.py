"""What a fit on a small or degenerate sweep may say (issue 50): a coefficient the data cannot identify is
said in words, `plan` ranks only the measured range of k unless asked, and the fit's uncertainty is carried
into the recommended k."""
import json
import re

import numpy as np
import pytest

from specserve.cli import main
from specserve.latency.fitting import model_file
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.decisions.planning import coefficient_draws, outside_measured, plan
from specserve.latency.fitting.regression import FittedCoefficients
from specserve.latency.decisions.report import coefficient_band, explain, term
from specserve.latency.records.runs import load_runs
from synthetic import Sweep, write_sweep

# As in the issue: two speculative configurations (k = 3, 4), four rates each, nothing else.
TWO_KS = (("k3", 3, 0.8), ("k4", 4, 0.8))
RATES = (0.15, 0.35, 0.55, 0.75)


def _sweep(tmp_path, noise, seed=0):
    """The sweep, with each run's measured acceptance length scattered by ~2 % as a real sweep's is: the
    runs then span every direction of (1, g/E, g·k/E), so the model is 'estimable' at any k, and only the
    measured range keeps `plan` from ranking k = 8 (as it did on the issue's 4-rate k = 3, 4 runs)."""
    path = write_sweep(tmp_path, Sweep(configs=TWO_KS, load_fractions=RATES, noise=noise, saturated=False,
                                       seed=seed))
    rng = np.random.default_rng(seed)
    lines = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        record["spec"]["mean_acceptance_length"] *= 1 + 0.02 * rng.standard_normal()
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def _fit(tmp_path, noise, seed=0):
    path = _sweep(tmp_path, noise, seed)
    return fit_runs(load_runs([path]), FitOptions(cross_validate=False), [str(path)])


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("small"), noise=0.01)


@pytest.fixture(scope="module")
def noisy(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("noisy"), noise=0.15, seed=3)


def test_plan_ranks_only_the_measured_k(small):
    m = small.model
    assert outside_measured(m, range(9)) == [0, 1, 2, 5, 6, 7, 8]
    rows = plan(m, [0.1, 0.5, 1.0], list(range(9)), extrapolate=False)
    assert {r.best_k for r in rows} <= {3, 4}
    # asked to extrapolate, it ranks the rest (the "k = 8 at every rate")
    wide = plan(m, [0.1], list(range(9)))
    assert set(wide[0].latencies) >= {5, 6, 7, 8}


def test_plan_cli_marks_the_measured_range(small, tmp_path, capsys):
    path = tmp_path / "model.json"
    model_file.save(small, path)
    assert main(["latency", "plan", str(path), "--rates", "0.1,0.5", "--draws", "100"]) == 0
    out = capsys.readouterr().out
    assert "measured k: 3,4" in out and "outside the measured range (--extrapolate ranks them): k=0,1,2,5,6,7,8" in out
    assert "coefficient draws from the fit's covariance" in out
    best = [line.split()[1] for line in out.splitlines()[1:3]]
    assert set(best) <= {"3", "4"}
    assert main(["latency", "plan", str(path), "--rates", "0.1", "--ks", "7,8"]) == 2
    assert "--extrapolate" in capsys.readouterr().err


def test_uncertainty_is_carried_into_the_choice(small, noisy):
    precise = plan(small.model, list(RATES), [3, 4], draws=300)
    vague = plan(noisy.model, list(RATES), [3, 4], draws=300)
    for row in precise + vague:
        assert sum(row.best_share.values()) == pytest.approx(1.0)
        lo, hi = row.best_band
        assert lo <= row.best <= hi
    # more scatter in the runs, wider bands and less certain choices
    width = lambda rows: np.mean([(r.best_band[1] - r.best_band[0]) / r.best for r in rows])  # noqa: E731
    assert width(vague) > 2 * width(precise)
    assert min(r.best_share[r.best_k] for r in vague) < min(r.best_share[r.best_k] for r in precise) or \
        min(r.best_share[r.best_k] for r in vague) < 0.95


def test_covariance_round_trips_and_old_files_fall_back_to_intervals(small, tmp_path):
    path = tmp_path / "model.json"
    model_file.save(small, path)
    loaded = model_file.load(path).model
    c = loaded.e2e.coefficients
    assert c.covariance == small.model.e2e.coefficients.covariance and c.covariance is not None
    assert coefficient_draws(loaded, 5)[1] == "covariance"
    data = json.loads(path.read_text())
    del data["e2e"]["covariance"]   # a file written before the covariance was kept
    path.write_text(json.dumps(data))
    old = model_file.load(path).model
    draws, source = coefficient_draws(old, 5)
    assert source == "independent intervals" and len(draws) == 5
    assert all(min(d.e2e.coefficients.values.values()) >= 0 for d in draws)   # clipped as the fit is


def _coefs(values, ci95, not_identifiable=()):
    return FittedCoefficients(values, ci95, tuple(not_identifiable), 20, 0.99, 1.0)


def test_a_coefficient_at_its_bound_is_said_in_words():
    c = _coefs({"c1v": 0.02, "c2v": 8.67e-16, "c2d": 3e-4, "c1d": 0.0},
               {"c1v": (0.018, 0.022), "c2v": (-1e-4, 2e-4), "c2d": (-1e-5, 6e-4), "c1d": None}, ["c1d"])
    assert c.status("c2v") == "at bound" and c.status("c2d") == "unresolved"
    assert c.status("c1v") == "resolved" and c.status("c1d") == "not identifiable"
    assert term(c, ["c2v"], 4 * 8.67e-16) == "no cost the runs can tell from zero (c2v at its lower bound 0)"
    assert term(c, ["c1d"], 0.0).startswith("a cost the runs cannot identify")
    assert term(c, ["c1v"], 0.02) == "20 ms"
    assert coefficient_band(c, "c2v").startswith("at its lower bound 0: the runs cannot tell it from zero")
    assert "not resolved from zero" in coefficient_band(c, "c2d")
    assert coefficient_band(c, "c1d") == "not identifiable from these runs (held at 0)"


def test_explain_and_fit_print_no_bound_noise(small, tmp_path, capsys):
    text = explain(small)
    # a value like "8.67e-13 ms" is never a measured cost
    assert not re.search(r"\de-\d+ (ms|s)\b", text)
    assert "(not ranked, outside the measured k 3,4: k=0,1,2,5,6,7,8; --extrapolate ranks them)" in text
    results = _sweep(tmp_path, noise=0.01)
    assert main(["latency", "fit", str(results), "-o", str(tmp_path / "m.json"), "--no-cross-validation"]) == 0
    assert not re.search(r"\de-\d+ (ms|s)\b", capsys.readouterr().out)
