"""The step cost model recovers known costs from synthetic step times, follows a machine that changes, and
profiles a real (tiny) model once per configuration."""
import numpy as np
import pytest

from specserve.spec.cost_model import KNOTS, LinearCost, StepCostModel, _fit, features


def truth(rows, kv):
    """A memory-bound step that turns compute-bound past 24 rows, plus attention's KV reads."""
    rows, kv = np.asarray(rows, float), np.asarray(kv, float)
    return 0.004 + 0.00012 * np.maximum(rows - 24, 0) + 0.0015 * kv / 1000


def test_the_fit_recovers_a_known_cost_curve_and_kv_term():
    rng = np.random.default_rng(0)
    rows = np.r_[KNOTS[KNOTS <= 512], rng.integers(1, 513, 60)]
    kv = rng.integers(100, 20000, len(rows))
    cost = _fit(np.c_[rows, kv, truth(rows, kv)].tolist())
    test_rows, test_kv = rng.integers(1, 513, 200), rng.integers(100, 20000, 200)
    predicted = cost.predict(features(test_rows, test_kv))
    # piecewise-linear in rows with knots at powers of two: exact at knots, close between them
    assert np.max(np.abs(predicted - truth(test_rows, test_kv)) / truth(test_rows, test_kv)) < 0.03
    assert cost.w[-1] == pytest.approx(0.0015, rel=0.02)  # seconds per thousand KV tokens
    assert cost.predict(features([4096], [0]))[0] == pytest.approx(truth(4096, 0), rel=0.02)  # extrapolated


def test_recursive_least_squares_follows_a_machine_that_slows_down():
    rng = np.random.default_rng(1)
    rows = np.r_[KNOTS[KNOTS <= 256], rng.integers(1, 257, 40)]
    kv = rng.integers(100, 5000, len(rows))
    model = StepCostModel(_fit(np.c_[rows, kv, truth(rows, kv)].tolist()), {})
    test_rows = rng.integers(1, 257, 100)
    slower = 1.3 * truth(test_rows, 2000)
    before = np.abs(model.verify_time(test_rows, 2000) - slower) / slower
    for _ in range(600):  # the machine is now 30 % slower (another tenant), with 5 % noise
        r, k = int(rng.integers(1, 257)), int(rng.integers(100, 5000))
        model.observe(r, k, 1.3 * truth(r, k) * (1 + 0.05 * rng.standard_normal()), [], 0.0)
    after = np.abs(model.verify_time(test_rows, 2000) - slower) / slower
    assert np.median(before) > 0.2 and np.median(after) < 0.05
    assert 0.02 < model.relative_error < 0.15  # the running error settles near the noise


def test_steps_at_a_few_row_counts_do_not_wind_up_the_rest_of_the_curve():
    """Under steady load the steps carry a few row counts only (here 2 to 6 decodes, noisy, varying KV),
    then a few speculative steps carry 17 to 31 rows. Forgetting must not have wound up the knots the
    load left alone, or those few noisy steps swing them anywhere: the curve stays near the truth and a
    policy's view of it never gets cheaper with more rows."""
    rng = np.random.default_rng(2)
    rows = np.r_[KNOTS[KNOTS <= 256], rng.integers(1, 257, 40)]
    kv = rng.integers(100, 5000, len(rows))
    model = StepCostModel(_fit(np.c_[rows, kv, truth(rows, kv)].tolist()), {})
    for _ in range(3000):
        r, k = int(rng.integers(2, 7)), int(rng.integers(100, 3000))
        model.observe(r, k, truth(r, k) * (1 + 0.15 * rng.standard_normal()), [], 0.0)
    for _ in range(10):
        r, k = int(rng.integers(17, 32)), int(rng.integers(100, 3000))
        model.observe(r, k, truth(r, k) * (1 + 0.15 * rng.standard_normal()), [], 0.0)
    assert np.all(np.diag(model.verify.P) <= model.verify.max_var * (1 + 1e-9))  # not wound up
    grid = np.arange(1, 129)
    error = np.abs(model.verify_time(grid, 2000) - truth(grid, 2000)) / truth(grid, 2000)
    assert np.max(error) < 0.25, np.max(error)
    assert np.all(np.diff(model.verify_curve(grid, 2000 + grid)) >= 0)


def test_linear_cost_update_is_exact_on_consistent_data():
    cost = LinearCost(np.zeros(3), forgetting=1.0, prior=1e4)
    rng = np.random.default_rng(2)
    w = np.array([0.5, -1.0, 2.0])
    for _ in range(200):
        f = rng.standard_normal(3)
        cost.update(f, float(f @ w))
    assert np.allclose(cost.w, w, atol=1e-3)


def test_profile_of_a_tiny_model_is_cached(tiny_target, tiny_draft, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    from specserve import LLM
    spec = {"model": str(tiny_draft), "num_speculative_tokens": 2, "policy": "adaptive"}
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_batched_tokens=64, speculative_config=spec)
    cost = llm.engine.models.cost
    files = list((tmp_path / "cost_profiles").glob("*.json"))
    assert len(files) == 1 and set(cost.drafts) == {"draft"}
    assert cost.verify_time(32, 1000)[0] > 0 and cost.draft_time("draft", 4, 100)[0] > 0
    assert cost.draft_time("ngram", 4, 100)[0] == 0  # prompt lookup runs no model
    stamp = files[0].stat().st_mtime_ns
    again = LLM(model=str(tiny_target), dtype="float32", max_num_batched_tokens=64,
                speculative_config=spec).engine.models.cost
    assert files[0].stat().st_mtime_ns == stamp and np.allclose(again.verify.w, cost.verify.w)
