"""`specserve latency ...` end to end on a synthetic results file."""
import json

import matplotlib.image
import pytest

from specserve.cli import main
from specserve.latency.fitting import model_file
from specserve.latency.fitting.crossval import standard_error, summarize
from specserve.latency.records.runs import load_runs
from specserve.latency.fitting.validate import BIAS_COLUMN, GOALS, PHASE_GOAL, SE_COLUMNS, markdown, phase_goal_line, render


@pytest.fixture(scope="module")
def model_json(sweep_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "model.json"
    assert main(["latency", "fit", str(sweep_file), "-o", str(out)]) == 0
    return out


def test_fit_writes_model_and_lists_exclusions(model_json, capsys):
    report = model_file.load(model_json)
    assert len(report.excluded) == 3 and set(report.cross_validation) == {"rate", "configuration"}
    assert main(["latency", "fit", str(report.sources[0]), "-o", str(model_json.with_name("m2.json")),
                 "--no-cross-validation"]) == 0
    out = capsys.readouterr().out
    assert "3 excluded (saturated or not steady)" in out and "preemptions" in out and "c2d" in out


def test_predict_text_and_json(model_json, capsys):
    assert main(["latency", "predict", str(model_json), "--rate", "1.0", "--k", "4", "--alpha", "0.8",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    m = model_file.load(model_json).model
    pred = m.predict(1.0, 4, 1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert data["e2e_s"] == pytest.approx(pred.e2e) and data["tpot_s"] == pytest.approx(pred.tpot)
    assert data["speedup"] == pytest.approx(m.latency(1.0, 0, 1.0) / pred.e2e)
    assert data["quantiles_s"]["e2e"]["p99"] > data["e2e_s"]
    assert main(["latency", "predict", str(model_json), "--rate", "0.5", "--k", "2",
                 "--alphas", "0.9,0.5"]) == 0
    out = capsys.readouterr().out
    assert "E=2.350" in out and "break-even" in out  # 1 + 0.9 + 0.45
    # far past saturation: inf, reported as saturated rather than a number
    assert main(["latency", "predict", str(model_json), "--rate", "50", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["saturated"] is True and data["e2e_s"] is None


def test_predict_length_classes(model_json, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt_tokens": 100 + i, "output_tokens": 20 + 10 * i}) + "\n"
                            for i in range(40)))
    assert main(["latency", "predict", str(model_json), "--rate", "0.5", "--lengths", str(rows), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    classes = data["length_classes"]
    assert len(classes) == 4 and sum(c["weight"] for c in classes) == pytest.approx(1.0)
    assert [c["e2e_s"] for c in classes] == sorted(c["e2e_s"] for c in classes)


def test_plan_and_explain(model_json, capsys):
    assert main(["latency", "plan", str(model_json), "--rates", "0.1,0.8", "2.5", "--alpha", "0.8",
                 "--slo-e2e-ms", "4000"]) == 0
    out = capsys.readouterr().out
    assert "break-even" in out and "most load within 4000 ms" in out and "MISSED" in out
    assert main(["latency", "plan", str(model_json), "--rates", "0.1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    # measured: k = 0, 1, 2, 4, 6; k = 7 and 8 lie outside and are not ranked unless asked
    assert data["rows"][0]["best_k"] >= 1 and set(data["break_even"]) == {str(k) for k in range(1, 7)}
    assert data["outside_measured_k"] == [7, 8] and data["unmeasured_k"] == [3, 5]
    assert main(["latency", "plan", str(model_json), "--rates", "0.1", "--json", "--extrapolate"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["break_even"]) == {str(k) for k in range(1, 9)} and data["outside_measured_k"] == []
    assert main(["latency", "explain", str(model_json)]) == 0
    assert "C1R" in capsys.readouterr().out


def test_plot_writes_three_nontrivial_pngs(model_json, sweep_file, tmp_path):
    out = tmp_path / "plots"
    assert main(["latency", "plot", str(model_json), str(sweep_file), "-o", str(out)]) == 0
    for name in ("collapse", "latency_vs_rate", "speedup_vs_load"):
        path = out / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.std() > 0.05  # drawn on, not a blank canvas


@pytest.mark.parametrize("argv, message", [
    (["predict", "{m}", "--rate", "1", "--k", "4", "--alpha", "1.5"], "alpha must be in (0, 1]"),
    (["predict", "{m}", "--rate", "-1"], "rate must be"),
    (["plan", "{m}", "--rates", "1,x"], "list of numbers"),
    (["fit", "{m}", "-o", "{m}.out"], "it is a latency model, not bench results"),
    (["fit", "nope.jsonl", "-o", "x.json"], "cannot read results file"),
    (["fit", "{r}", "-o", "x.json", "--moe", "8"], "ACTIVE/EXPERTS"),
    (["fit", "{r}", "-o", "x.json", "--k", "k4"], "LABEL=VALUE"),
    (["predict", "{m}", "--rate", "1", "--arrival-cv", "0"], "arrival CV must be in"),
    (["plan", "{m}", "--rates", "1", "--arrival-cv", "9"], "arrival CV must be in"),
])
def test_user_errors_are_one_line(model_json, sweep_file, tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(m=model_json, r=sweep_file) for a in argv]
    assert main(["latency", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_validate_tables(fitted, sweep_file, tmp_path, capsys):
    text = markdown(fitted)
    assert text.count("| rate #") == 8 and "| k6 (k=6) |" in text
    assert f"goal: mean E2E MAPE <= {GOALS['rate']:g}%: met" in text
    assert f"goal: mean E2E MAPE <= {GOALS['configuration']:g}%: met" in text
    assert all(name in text for _, name in SE_COLUMNS) and BIAS_COLUMN in text
    assert text.count(f"goal: mean TTFT and TPOT MAPE <= {PHASE_GOAL:g}%: TTFT: met") == 2
    from rich.console import Console

    console = Console(record=True, width=140)
    render(fitted, console)
    shown = console.export_text()
    assert "Held-out rates" in shown and "not predicted" not in shown  # TTFT's load rides on the cycle
    md = tmp_path / "v.md"
    assert main(["latency", "validate", str(sweep_file), "--markdown", str(md)]) == 0
    assert md.read_text() == text


def test_validate_piped_prints_whole_tables_and_json(sweep_file, capsys):
    # capsys is no terminal: rich would assume 80 columns and cut the headers to "MAP…"
    assert main(["latency", "validate", str(sweep_file)]) == 0
    shown = capsys.readouterr().out
    assert "…" not in shown
    header = next(line for line in shown.splitlines() if "held out" in line)
    assert all(name in header for name in ("E2E MAPE", "TTFT MAPE", "TPOT MAPE", "E2E p95 MAPE", "E2E p99 MAPE",
                                           BIAS_COLUMN, *(name for _, name in SE_COLUMNS)))
    assert "Held-out configurations (leave one (alpha, k) out)" in shown and "all held-out points" in shown
    assert main(["latency", "validate", str(sweep_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["cross_validation"]) == {"rate", "configuration"}
    assert data["e2e_mape_goals_pct"] == GOALS and len(data["excluded"]) == 3
    overall = data["cross_validation"]["rate"]["overall"]["e2e"]["mape"]
    assert f"met ({overall:.2f}%)" in shown


@pytest.mark.parametrize("pairs, mape, bias", [
    ([(10.0, 11.0), (10.0, 8.0)], 15.0, -5.0),       # scatter: errors of both signs, bias smaller than MAPE
    ([(10.0, 9.0), (20.0, 18.0)], 10.0, -10.0),      # a systematic miss: |bias| equals the MAPE
    ([(4.0, 5.0)], 25.0, 25.0),
    ([(4.0, 5.0), (4.0, float("inf"))], float("inf"), float("inf")),  # a saturated prediction
])
def test_summary_reports_mape_and_signed_bias(pairs, mape, bias):
    summary = summarize([{"e2e": pair} for pair in pairs])["e2e"]
    assert summary == {"mape": pytest.approx(mape), "bias": pytest.approx(bias), "n": len(pairs)}


def test_noise_column_is_each_run_means_standard_error(sweep_file):
    runs = load_runs([sweep_file])
    # The synthetic runs' E2E spread is 0.3 x their mean: each mean is known to 30 % / sqrt(requests).
    expected = sum(30.0 / r.num_completed ** 0.5 for r in runs) / len(runs)
    assert standard_error(runs) == pytest.approx(expected)
    assert standard_error([]) is None
    # Where the requests' rows give the spread their lengths do not explain, that replaces the raw one.
    halved = {r.source: 0.15 * r.e2e.mean for r in runs}
    assert standard_error(runs, halved) == pytest.approx(expected / 2)
    # TTFT and TPOT: each run's own spread (also 0.3 x the mean); the E2E residual spread is not theirs.
    for metric in ("ttft", "tpot"):
        assert standard_error(runs, halved, metric) == pytest.approx(expected)


def test_phase_goal_line_compares_the_error_with_the_noise():
    result = {"overall": {"ttft": {"mape": 13.5}, "tpot": {"mape": 5.3}}, "se": {"ttft": 10.9, "tpot": 5.7}}
    line = phase_goal_line(result)
    assert "TTFT: MISSED (13.50%; noise alone gives a perfect model 8.70%, above the goal" in line
    assert "TPOT: met (5.30%; noise alone gives a perfect model 4.55%, within the goal)" in line


def test_arrival_cv_is_fitted_saved_and_overridable(tmp_path, capsys):
    from synthetic import Sweep, write_sweep

    results = write_sweep(tmp_path, Sweep(configs=(("no-sd", 0, None), ("k2", 2, 0.75)), saturated=False,
                                          rows=False, arrival_cv=0.25))
    out = tmp_path / "m.json"
    assert main(["latency", "fit", str(results), "-o", str(out), "--no-cross-validation"]) == 0
    assert "arrival-gap CV 0.25" in capsys.readouterr().out
    assert model_file.load(out).model.arrival_cv == 0.25
    e2e = {}
    for cv in (None, "0.25", "1"):
        argv = ["latency", "predict", str(out), "--rate", "1.5", "--k", "2", "--json"]
        assert main(argv + ([] if cv is None else ["--arrival-cv", cv])) == 0
        data = json.loads(capsys.readouterr().out)
        e2e[cv] = data["e2e_s"]
        assert data["arrival_cv"] == (0.25 if cv is None else float(cv))
    assert e2e[None] == e2e["0.25"] < e2e["1"]  # Poisson arrivals at the same rate meet more company
    assert main(["latency", "plan", str(out), "--rates", "1.5", "--ks", "0,2", "--arrival-cv", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["e2e_by_k_s"]["2"] == pytest.approx(e2e["1"])
    poisson = tmp_path / "p.json"
    assert main(["latency", "fit", str(results), "-o", str(poisson), "--no-cross-validation",
                 "--assume-poisson"]) == 0
    assert "taken as Poisson" in capsys.readouterr().out
    assert model_file.load(poisson).model.arrival_cv == 1.0
    # the collapse plot puts every configuration on y = company(x) instead of 1/(1 - x)
    assert main(["latency", "plot", str(out), str(results), "-o", str(tmp_path / "plots")]) == 0
    image = matplotlib.image.imread(tmp_path / "plots" / "collapse.png")
    assert image.shape[0] > 300 and image.std() > 0.05


def test_predict_averages_over_a_traces_rate_drift(model_json, tmp_path, capsys):
    from tests.latency.test_rate_drift import modulated_arrivals

    trace = tmp_path / "drifting.csv"
    trace.write_text("timestamp\n" + "\n".join(f"{t:.6f}" for t in modulated_arrivals(20_000, 0.8, 0.3, 300.0, 4)))
    assert main(["latency", "predict", str(model_json), "--rate", "2.0", "--trace", str(trace), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    drift = data["rate_drift"]
    assert data["arrival_cv"] == drift["arrival_cv"] == pytest.approx(0.8, rel=0.1)
    assert drift["variance"] == pytest.approx(0.09, rel=0.35)
    assert drift["e2e_s"] > data["e2e_s"]   # convex in the rate: the busy spells cost more than the quiet save
    assert main(["latency", "predict", str(model_json), "--rate", "2.0", "--trace", str(trace)]) == 0
    assert "over the trace's rate drift" in capsys.readouterr().out
