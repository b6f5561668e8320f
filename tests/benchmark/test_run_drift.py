"""bench/run_drift.py: a slow spell in a sweep shows as the runs of that time sitting above their lines."""
import importlib.util
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
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


def _probe(minute: float, e2e: float) -> dict:
    started = datetime(2026, 11, 26, 12, 0) + timedelta(minutes=minute)
    return {"schema": "specserve.bench.run/1", "run_id": f"probe{minute}", "num_completed": 2,
            "e2e_s": {"mean": e2e}, "started_at": started.isoformat()}


def test_a_runs_slowness_is_the_probes_either_side_of_it_over_their_median():
    probes = [_probe(0, 4.0), _probe(10, 4.4), _probe(20, 3.6), _probe(30, 4.0)]
    runs = [{"run_id": str(m), "started_at": _probe(m, 0)["started_at"]} for m in (5, 15, 25, 35)]
    slow = run_drift.probe_slowness(runs, probes[::-1])
    assert slow == pytest.approx({"5": 1.05, "15": 1.0, "25": 0.95, "35": 1.0})   # the last: one probe only


def _slowed_sweep(tmp_path: Path, slowness) -> tuple[Path, Path]:
    """Synthetic sweep (tests/latency/synthetic.py, noise 0.5 %) with run n started at minute 2n on a
    machine `slowness(n)` times slower than the coefficients say, and a probe between every two runs that
    sees the same slowness."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "latency"))
    from synthetic import Sweep, write_sweep

    results = write_sweep(tmp_path, Sweep(saturated=False, rows=False, arrival_cv=0.25))
    records = [json.loads(line) for line in results.read_text().splitlines()]
    order = np.random.default_rng(1).permutation(len(records))     # configurations and rates mixed in time
    t0 = datetime(2026, 11, 26, 12, 0)
    for n, i in enumerate(order):
        r, s = records[i], slowness(n)
        r["started_at"] = (t0 + timedelta(minutes=2 * n)).isoformat()
        for key in ("e2e_s", "ttft_s", "tpot_s"):
            r[key] = {q: v * s for q, v in r[key].items()}
        for key in ("offered_rate", "achieved_rate", "arrival_rate", "in_flight_slope"):
            r[key] /= s
        r["duration_s"] *= s
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    probes = tmp_path / "results.probes.jsonl"
    probes.write_text("".join(json.dumps(_probe(2 * n - 1, 3.0 * slowness(n))) + "\n"
                              for n in range(len(records) + 1)))
    return results, probes


def test_rescaling_a_run_by_its_slowness_undoes_a_slower_machine(tmp_path):
    from specserve.latency.runs import load_runs

    results, _ = _slowed_sweep(tmp_path, lambda n: 1.0)
    run = load_runs([results])[0]
    back = run_drift.at_median_speed(run_drift.at_median_speed(run, 1 / 1.2), 1.2)
    assert back.e2e.mean == pytest.approx(run.e2e.mean) and back.tpot.p99 == pytest.approx(run.tpot.p99)
    assert back.achieved_rate == pytest.approx(run.achieved_rate) and back.in_flight == pytest.approx(run.in_flight)


def test_probes_take_a_slow_spell_out_of_the_held_out_errors(tmp_path):
    # The middle third of the sweep runs 15 % slow: as measured the held-out rates miss by several
    # percent; rescaled by the probes they are back near the synthetic noise (the two runs at the slow
    # spell's edges take the mean of a fast and a slow probe, 7.5 % off).
    results, probes = _slowed_sweep(tmp_path, lambda n: 1.15 if 13 <= n < 27 else 1.0)
    rows = run_drift.residuals(run_drift.read_runs(results))
    got = run_drift.speed_report(str(results), str(probes), rows)
    assert got["rate_mape"] > 5.0 and got["rate_mape_rescaled"] < 2.0
    assert got["correlation"] > 0.8 and got["spread_divided"] < got["spread"] / 2
