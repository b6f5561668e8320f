"""bench/run_drift.py: a slow spell in a sweep shows as the runs of that time sitting above their lines."""
import importlib.util
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from specserve.latency.equations.arrival_regularity import company

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
    from specserve.latency.records.runs import load_runs

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
    slow = run_drift.probe_slowness([r for r, _ in rows], run_drift.read_runs(probes))
    tracked = run_drift.track("probes", slow, rows)
    assert tracked["correlation"] > 0.8 and tracked["spread_divided"] < tracked["spread"] / 2
    mape = run_drift.validations(str(results), {"probes": slow})
    assert mape["measured"] > 5.0 and mape["probes"] < 2.0


def _request(sent: float, first: float, chunks: list[float], measured: bool = True) -> dict:
    return {"sent_s": sent, "first_token_s": first, "end_s": first + sum(chunks), "itl_s": chunks,
            "measured": measured}


def test_a_chunk_counts_the_requests_decoding_through_it_and_skips_others_prefills():
    alone_then_two = _request(0.0, 0.2, [0.1] * 6)           # chunks end at 0.3, 0.4, ..., 0.8
    joins = _request(0.35, 0.55, [0.2] * 2)                  # prefilled 0.35-0.55, decoding 0.55-0.95
    warm_up = _request(0.0, 0.1, [0.05], measured=False)     # company, but its chunks are not counted
    chunks = run_drift.step_chunks([alone_then_two, joins, warm_up])
    # alone_then_two: chunk 0.2-0.3 alone; 0.3-0.4, 0.4-0.5 and 0.5-0.6 overlap the prefill (left out);
    # 0.6-0.7 and 0.7-0.8 beside `joins`. joins: 0.55-0.75 beside alone_then_two (which ends at 0.8),
    # 0.75-0.95 beside it for part of the chunk only, so alone.
    assert [b for b, _ in chunks] == [1, 2, 2, 2, 1]
    assert [t for _, t in chunks] == pytest.approx([0.1, 0.1, 0.1, 0.2, 0.2])


def _lone_run(run_id: str, label: str, chunk: float, n: int = 60) -> tuple[dict, list[dict]]:
    """A run of `n` one-chunk requests back to back, each alone, every chunk `chunk` seconds."""
    rows = [dict(_request(2.0 * i, 2.0 * i + 0.5, [chunk]), run=run_id) for i in range(n)]
    return {"run_id": run_id, "label": label}, rows


def test_a_runs_step_slowness_compares_its_steps_with_its_configurations_at_the_same_batch_size():
    (fast, fast_rows), (slow, slow_rows) = _lone_run("fast", "k1", 0.10), _lone_run("slow", "k1", 0.11)
    (other, other_rows), (few, few_rows) = _lone_run("other", "k4", 0.30), _lone_run("few", "k2", 0.2, n=10)
    rows = {"fast": fast_rows, "slow": slow_rows, "other": other_rows, "few": few_rows}
    got = run_drift.step_slowness([fast, slow, other, few], rows)
    # k1's reference is the median of both runs' chunks, 0.105 s; k4 has one run, which is its own
    # reference; k2's 10 chunks are too few for a reference, so that run gets no slowness.
    assert got == pytest.approx({"fast": 0.10 / 0.105, "slow": 0.11 / 0.105, "other": 1.0})
    assert got["slow"] / got["fast"] == pytest.approx(1.1)
