"""Planning on a fitted model agrees with the closed forms; model.json round-trips exactly."""
import json
import math

import pytest

from specserve.errors import SpecServeError
from specserve.latency.fitting import model_file
from specserve.latency.equations.acceptance import expected_tokens
from specserve.latency.fitting.e2e import SIX
from specserve.latency.equations.formulas import SpecCoefficients, best_k_at_rate, best_k_under_target, break_even
from specserve.latency.decisions.planning import best_k_bands, break_even_for, candidate_ks, max_rate_within, plan
from specserve.latency.decisions.report import explain

KS = list(range(0, 9))


def _coefs(model):
    return SpecCoefficients(**{n: model.e2e.coefficients[n] for n in SIX})


def test_plan_matches_closed_form_best_k(fitted):
    m = fitted.model
    coefs = _coefs(m)
    for row in plan(m, [0.05, 0.5, 1.0, 2.0], KS, alpha=0.8):
        k, lat = best_k_at_rate(coefs, row.rate, m.output_tokens, 0.8, KS)
        assert row.best_k == k and row.best == pytest.approx(lat)
        assert row.dense == pytest.approx(coefs.dense(m.output_tokens).latency(row.rate))
    k, rate = best_k_under_target(coefs, 4.0, m.output_tokens, 0.8, KS)
    e = expected_tokens(0.8, k) if k else 1.0
    assert max_rate_within(m, k, e, 4.0) == pytest.approx(rate)


def test_break_even_and_bands_are_consistent(fitted):
    m = fitted.model
    e = expected_tokens(0.8, 4)
    be = break_even_for(m, 4, e)
    assert be == break_even(m.demands(0, 1.0), m.demands(4, e))
    assert be.regime == "sd-wins-below"
    assert m.latency(be.rate, 4, e) == pytest.approx(m.latency(be.rate, 0, 1.0))
    bands = best_k_bands(m, KS, alpha=0.8)
    assert [k for k, _, _ in bands] == sorted((k for k, _, _ in bands), reverse=True)  # k falls with load
    assert bands[0][1] == 0 and bands[-1][0] == 0
    for (k1, _, edge), (k2, start, _) in zip(bands, bands[1:]):
        assert edge == start
        e1 = expected_tokens(0.8, k1) if k1 else 1.0
        e2 = expected_tokens(0.8, k2) if k2 else 1.0
        assert m.latency(edge, k1, e1) == pytest.approx(m.latency(edge, k2, e2), rel=1e-6)
    assert bands[-1][2] == pytest.approx(m.demands(0, 1.0).saturation_rate)


def test_measured_acceptance_is_the_default(fitted):
    m = fitted.model
    assert candidate_ks(m, [0, 4])[0][4] == m.configuration(4).acceptance_length
    rows = plan(m, [10.0], [0, 2])
    assert rows[0].best_k is None and math.isinf(rows[0].best)  # beyond every saturation rate


def test_model_file_round_trip(fitted, tmp_path):
    path = tmp_path / "model.json"
    model_file.save(fitted, path)
    data = json.loads(path.read_text())  # strict JSON: no NaN/Infinity tokens
    assert data["schema"] == "specserve.latency.model/1"
    assert set(data["e2e"]["values"]) == set(SIX) and len(data["excluded"]) == 3
    loaded = model_file.load(path)
    for rate, k, e in [(0.3, 0, 1.0), (1.0, 4, 2.5), (1.2, 6, 3.0)]:
        a, b = fitted.model.predict(rate, k, e), loaded.model.predict(rate, k, e)
        assert (a.e2e, a.ttft, a.tpot, a.quantiles) == (b.e2e, b.ttft, b.tpot, b.quantiles)
    assert loaded.cross_validation == json.loads(json.dumps(fitted.cross_validation))
    assert explain(loaded) == explain(fitted)


def test_model_file_errors(tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(json.dumps({"schema": "specserve.latency.model/9"}))
    with pytest.raises(SpecServeError, match="not supported"):
        model_file.load(bad)
    bad.write_text(json.dumps({"schema": "specserve.latency.model/1", "e2e": {}}))
    with pytest.raises(SpecServeError, match="malformed"):
        model_file.load(bad)
    bad.write_text("{")
    with pytest.raises(SpecServeError, match="not JSON"):
        model_file.load(bad)


def test_explain_states_the_numbers(fitted):
    text = explain(fitted, alpha=0.8)
    m = fitted.model
    dense, sd = m.demands(0, 1.0), m.demands(4, m.configuration(4).acceptance_length)
    assert f"C1R = {sd.c1 / dense.c1:.2f}, C2R = {sd.c2 / dense.c2:.2f}" in text
    assert f"{dense.c1 / sd.c1:.2f}x as fast" in text
    be = break_even_for(m, 4, m.configuration(4).acceptance_length)
    assert f"Break-even at {be.rate:.3g} req/s" in text
    assert "Under load the speedup shrinks" in text and "Excluded 3 saturated run(s)" in text
    assert "Best k by rate (alpha = 0.8)" in text and "no SD:" in text
