"""The README's latency18 row is what `specserve latency validate` prints for the committed sweep.

A change to the fit that moves these numbers must update the README (and docs/latency.md) with them."""
import re
from pathlib import Path

from specserve.latency.validate import validate_files

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "bench" / "results" / "latency18" / "fixed.jsonl"


def test_readme_latency18_row_matches_the_committed_results():
    report = validate_files([SWEEP])
    assert not report.excluded  # 40 of 40 runs kept, as the README says
    rate = report.cross_validation["rate"]["overall"]["e2e"]["mape"]
    configuration = report.cross_validation["configuration"]["overall"]["e2e"]["mape"]
    rows = [line for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| latency18, latency17's command repeated")]
    assert len(rows) == 1, rows
    headline = re.search(r"\| ([\d.]+) / \*\*([\d.]+) %\*\* \|", rows[0])
    assert headline, rows[0]
    assert f"{rate:.2f}" == headline.group(1)
    assert f"{configuration:.2f}" == headline.group(2)
