"""The README's rows for the committed sweeps are what `specserve latency validate` (and, rescaled to the
in-run speed, `bench/run_drift.py --step-times`) print for them.

A change to the fit that moves these numbers must update the README (and docs/latency.md) with them."""
import importlib.util
import re
from pathlib import Path

import pytest

from specserve.latency.fit import FitOptions, fit_runs
from specserve.latency.runs import load_runs
from specserve.latency.validate import validate_files

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
README = (ROOT / "README.md").read_text().splitlines()


def _row(prefix: str) -> str:
    rows = [line for line in README if line.startswith(prefix)]
    assert len(rows) == 1, rows
    return rows[0]


def _held_out(report) -> tuple[str, str]:
    return tuple(f"{report.cross_validation[by]['overall']['e2e']['mape']:.2f}" for by in ("rate", "configuration"))


@pytest.mark.parametrize("sweep, prefix", [("latency18", "| latency18, latency17's command repeated"),
                                           ("latency19", "| latency19, latency18's command repeated"),
                                           ("latency20", "| **latency20**, latency19's command repeated")])
def test_readme_row_matches_the_committed_results(sweep, prefix):
    report = validate_files([RESULTS / sweep / "fixed.jsonl"])
    assert not report.excluded  # 40 of 40 runs kept, as the README says
    headline = re.search(r"\| (?:\*\*)?([\d.]+) / (?:\*\*)?([\d.]+) %(?:\*\*)? \|", _row(prefix))
    assert headline, prefix
    assert _held_out(report) == headline.groups()


def test_readme_in_run_speed_row_matches_the_committed_results():
    spec = importlib.util.spec_from_file_location("run_drift", ROOT / "bench" / "run_drift.py")
    run_drift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_drift)
    got = []
    for sweep in ("latency18", "latency19", "latency20"):
        results = RESULTS / sweep / "fixed.jsonl"
        slow = run_drift.step_slowness(run_drift.read_runs(results), run_drift.read_request_rows(results))
        runs = [run_drift.at_median_speed(r, slow[r.run_key]) for r in load_runs([results])]
        assert len(runs) == 40  # every run has a slowness
        got += _held_out(fit_runs(runs, FitOptions()))
    row = _row("| latency18 / latency19 / latency20 at the in-run speed")
    e2e = row.split(" | ")[2]  # the E2E MAPE cell: "rate / configuration %" per sweep
    assert tuple(n for pair in re.findall(r"([\d.]+) / ([\d.]+) %", e2e) for n in pair) == tuple(got)
