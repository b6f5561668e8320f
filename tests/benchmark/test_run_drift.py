"""bench/run_drift.py: a slow spell in a sweep shows as the runs of that time sitting above their lines."""
import importlib.util
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from specserve.latency.arrivals import company

spec = importlib.util.spec_from_file_location("run_drift", Path(__file__).parents[2] / "bench" / "run_drift.py")
run_drift = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_drift)


def _runs(slow_from: int, slowdown: float) -> list[dict]:
    """Two configurations interleaved, 12 runs, each exactly on its line until run `slow_from`."""
    t0, runs = datetime(2026, 11, 26, 12, 0), []
    for n in range(12):
        c1, c2 = (4.0, 0.5) if n % 2 == 0 else (3.0, 1.0)
        load = 0.3 + 0.4 * [3, 0, 5, 1, 4, 2][n // 2]     # load not tied to time, as interleaved
        e2e = (c1 + c2 * float(company(load, 0.25))) * (slowdown if n >= slow_from else 1.0)
        runs.append({"run_id": str(n), "label": f"c{n % 2}", "num_completed": 10, "mean_in_flight": load,
                     "e2e_s": {"mean": e2e}, "started_at": (t0 + timedelta(minutes=2 * n)).isoformat(),
                     "arrival": {"process": "gamma", "burstiness": 0.25}, "sweep": {"fraction": 0.1 * (n // 2 + 1)}})
    return runs[::-1]     # out of order on purpose: residuals come back in start order


def test_runs_on_their_lines_leave_no_residual():
    rows = run_drift.residuals(_runs(slow_from=99, slowdown=1.0))
    assert [r["run_id"] for r, _ in rows] == [str(n) for n in range(12)]
    assert all(res == pytest.approx(0.0, abs=1e-9) for _, res in rows)


def test_a_slow_spell_shows_in_its_time():
    rows = run_drift.residuals(_runs(slow_from=8, slowdown=1.2))
    parts = run_drift.by_time(rows, parts=3)
    assert [n for n, _ in parts] == [4, 4, 4]
    assert parts[2][1] > 5.0 and parts[0][1] < 0.0 and parts[1][1] < 0.0
