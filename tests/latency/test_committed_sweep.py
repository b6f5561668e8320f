"""The published validation numbers of the committed sweeps are what the code computes from their data.

README.md and docs/experiments/latency-validation.md quote held-out errors from the tables committed
beside each sweep's results: `bench/results/<sweep>/validate.md` (written by `specserve latency validate
bench/results/<sweep>/fixed.jsonl --markdown ...`) and `bench/results/<sweep>/drift.md` (written by
`python bench/run_drift.py bench/results/<sweep>/fixed.jsonl --step-times --quiet --markdown ...`). These
tests recompute the held-out errors from the committed runs and compare them with those tables, so a
change to the fit that moves a published number fails here until the tables are regenerated (and the
docs that quote them follow)."""
import importlib.util
import re
from pathlib import Path

import pytest

from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs
from specserve.latency.fitting.validate import validate_files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SWEEPS = ("latency18", "latency19", "latency20")
REPEATED = {"latency21": ("r1", "r2", "r3")}  # sweeps committed as repeats of one design: one results file each


def _committed_held_out(text: str) -> tuple[str, ...]:
    """The E2E MAPE of the "all held-out points" rows, in order (held-out rates, then configurations)."""
    return tuple(re.findall(r"^\| all held-out points \| \d+ \| ([\d.]+)% \|", text, re.MULTILINE))


def _held_out(report) -> tuple[str, str]:
    return tuple(f"{report.cross_validation[by]['overall']['e2e']['mape']:.2f}" for by in ("rate", "configuration"))


@pytest.mark.parametrize("sweep", SWEEPS)
def test_committed_validation_tables_match_the_committed_results(sweep):
    report = validate_files([RESULTS / sweep / "fixed.jsonl"])
    assert not report.excluded  # 40 of 40 runs kept, as the docs say
    committed = _committed_held_out((RESULTS / sweep / "validate.md").read_text())
    assert len(committed) == 2, committed
    assert _held_out(report) == committed


@pytest.mark.parametrize("sweep", REPEATED)
def test_committed_validation_tables_of_repeated_sweeps_match_their_results(sweep):
    report = validate_files([RESULTS / sweep / repeat / "fixed.jsonl" for repeat in REPEATED[sweep]])
    assert not report.excluded
    assert _held_out(report) == _committed_held_out((RESULTS / sweep / "validate.md").read_text())


@pytest.mark.parametrize("sweep", SWEEPS)
def test_committed_in_run_speed_tables_match_the_committed_results(sweep):
    spec = importlib.util.spec_from_file_location("run_drift", ROOT / "bench" / "run_drift.py")
    run_drift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_drift)
    results = RESULTS / sweep / "fixed.jsonl"
    slow = run_drift.step_slowness(run_drift.read_runs(results), run_drift.read_request_rows(results))
    runs = [run_drift.at_median_speed(r, slow[r.run_key]) for r in load_runs([results])]
    assert len(runs) == 40  # every run has a slowness
    text = (RESULTS / sweep / "drift.md").read_text()
    rescaled = text.split("### Held-out validation, runs at the sweep's median speed (step times)", 1)
    assert len(rescaled) == 2, "drift.md has no step-times section"
    committed = _committed_held_out(rescaled[1])
    assert len(committed) == 2, committed
    assert _held_out(fit_runs(runs, FitOptions())) == committed
