"""The step cost model recovers known costs from synthetic step times, follows a machine that changes, and
profiles a real (tiny) model once per configuration."""
import numpy as np
import pytest

from specserve.settings import settings
from specserve.spec_decode.cost_model import KNOTS, LinearCost, StepCostModel, _fit, features


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


def test_a_staircase_at_few_rows_is_fit_exactly():
    """CPU kernels work on rows in tiles: 3 rows cost what 2 do, 4 nearly twice as much. Every row count up to 8
    is a knot, so verify steps there are priced as measured, not interpolated between powers of two."""
    stairs = {1: 8.0, 2: 9.8, 3: 10.0, 4: 16.4, 5: 17.9, 6: 21.0, 7: 24.0, 8: 31.0}
    samples = [[n, 100 * n, t / 1e3] for n, t in stairs.items()] + [[n, 100 * n, n * 4e-3] for n in (12, 16, 24, 32)]
    cost = _fit(samples)
    for n, t in stairs.items():
        assert cost.predict(features([n], [100 * n]))[0] == pytest.approx(t / 1e3, rel=0.02)


def test_the_online_fit_follows_a_machine_that_slows_down():
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


def test_a_long_steady_load_does_not_make_the_online_fit_diverge():
    """A long stream of steps at the few row counts a steady load produces (mostly 1-12 rows, some
    prefill chunks), 20 % noise, the machine 30 % slower every other 2000 steps. Recursive least squares
    with forgetting wound up the knots this stream leaves alone and diverged on exactly this stream
    (relative error ~50 by step 8000 and up to 2500 later; with a cap on each weight's variance 10^5 by
    step 8000, 10^64 by 20000); the refit stays near the noise, and the curve a policy reads never gets
    cheaper with more rows."""
    rng = np.random.default_rng(0)
    slow = lambda r, kv: 0.025 + 0.004 * np.maximum(np.asarray(r, float) - 2, 0) + 0.005 * np.asarray(kv) / 1000  # noqa: E731
    knots = [r for r in KNOTS if r <= 512]
    samples = [[r, 129 * r if r <= 32 else 4128, 0.0] for r in knots] + [[1, 1024, 0.0], [32, 32768, 0.0]]
    for row in samples:
        row[2] = float(slow(row[0], row[1])) * (1 + 0.3 * abs(rng.standard_normal()))
    model = StepCostModel(_fit(samples), {})
    errors = []
    for i in range(20000):
        r = int(rng.choice([1, 2, 3, 4, 5, 6, 8, 12, 260, 300, 512], p=[.2, .2, .15, .15, .1, .05, .05, .04, .02, .02, .02]))
        k = int(rng.integers(100, 3000)) + (r if r < 100 else 0)
        model.observe(r, k, float(slow(r, k)) * (1 + 0.2 * rng.standard_normal()) * (1.3 if (i // 2000) % 2 else 1), [], 0.0)
        errors.append(model.relative_error)
    assert max(errors[1000:]) < 0.6, max(errors[1000:])  # the noise, and the lag after each 30 % jump
    grid = np.arange(1, 129)
    assert np.all(np.diff(model.verify_curve(grid, 2000 + grid)) >= 0)


def test_steps_at_one_row_carry_the_machines_speed_to_the_rows_they_never_run():
    """A profile taken while the machine was slow (1.7x) and a server that only ever runs 1-row steps (a
    policy that thinks drafting too dear never drafts): the rows it never runs must follow the machine's
    speed too, or drafting stays too dear for ever (a batch-1 server drafted nothing for this reason)."""
    rng = np.random.default_rng(3)
    rows = np.r_[KNOTS[KNOTS <= 64], rng.integers(1, 65, 20)]
    kv = rng.integers(100, 3000, len(rows))
    model = StepCostModel(_fit(np.c_[rows, kv, 1.7 * truth(rows, kv)].tolist()), {})
    for _ in range(300):
        k = int(rng.integers(100, 3000))
        model.observe(1, k, truth(1, k) * (1 + 0.05 * rng.standard_normal()), [], 0.0)
    unexercised = np.arange(2, 10)
    assert np.allclose(model.verify_time(unexercised, 2000), truth(unexercised, 2000), rtol=0.1)
    assert model.verify.speed == pytest.approx(1 / 1.7, rel=0.05)


def test_a_slow_first_draft_call_does_not_keep_drafting_dear_for_ever():
    """The first draft forward of a server ran 10x its profile (a warm-up); the policy then stopped
    drafting, so no later draft step could correct it. Steps without that draft age the outlier away."""
    rng = np.random.default_rng(4)
    rows = np.r_[KNOTS[KNOTS <= 64], rng.integers(1, 65, 20)]
    kv = rng.integers(100, 3000, len(rows))
    sweep = np.c_[rows, kv, truth(rows, kv)].tolist()
    model = StepCostModel(_fit(sweep), {"code": _fit(sweep)})  # the draft's profile: the target's curve
    profiled = model.draft_time("code", [1], 1000)[0]
    model.observe(1, 1000, truth(1, 1000), [("code", 1, 1000)], 10 * truth(1, 1000))
    assert model.draft_time("code", [1], 1000)[0] > 2 * truth(1, 1000)  # the outlier counts at first
    for _ in range(2000):  # plain steps only
        model.observe(1, 1000, truth(1, 1000), [], 0.0)
    assert model.draft_time("code", [1], 1000)[0] == pytest.approx(profiled, rel=0.05)


def test_linear_cost_update_is_exact_on_consistent_data():
    cost = LinearCost(np.zeros(3), forgetting=1.0, prior=1e4)
    rng = np.random.default_rng(2)
    w = np.array([0.5, -1.0, 2.0])
    for _ in range(200):
        f = rng.standard_normal(3)
        cost.update(f, float(f @ w))
    assert np.allclose(cost.w, w, atol=1e-3)


def test_profile_of_a_tiny_model_is_cached(tiny_target, tiny_draft, tmp_path, monkeypatch):
    monkeypatch.setattr(settings, "cache", tmp_path)
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


def test_row_basis_table_equals_the_computed_basis():
    """Whole row counts come from a precomputed table; fractional or larger ones are computed: both agree."""
    from specserve.spec_decode import cost_model
    for rows in (np.arange(0, 5000), np.array([0, 1, 3, 4096]), 7, [2.5, 9000.0], np.array([4097, 10000])):
        assert np.array_equal(cost_model.row_basis(rows), cost_model._row_basis(rows))


def test_the_tabled_curve_equals_the_features_and_follows_updates():
    rng = np.random.default_rng(4)
    rows = np.r_[KNOTS[KNOTS <= 512], rng.integers(1, 513, 40)]
    kv = rng.integers(100, 20000, len(rows))
    cost = _fit(np.c_[rows, kv, truth(rows, kv)].tolist())
    grid, kv_grid = np.arange(0, 600), 3000 + np.arange(0, 600)
    assert np.allclose(cost.by_rows(grid, kv_grid), cost.predict(features(grid, kv_grid)))
    for r in (1, 2, 3, 8):
        cost.update(features(r, 2000)[0], 3 * float(truth(r, 2000)))  # the machine slowed down
    assert np.allclose(cost.by_rows(grid, kv_grid), cost.predict(features(grid, kv_grid)))
    assert np.allclose(cost.by_rows([5000], [0]), cost.predict(features([5000], [0])))  # past the table
