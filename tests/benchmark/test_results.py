import json
import math

import pytest

from specserve.benchmark.results import (RUN_KEYS, SCHEMA, append_run, clean, read_request_rows, read_runs,
                                         requests_path, validate_run)
from specserve.errors import SpecServeError


def minimal_record(**over):
    stats = {"mean": 1.0, "median": 1.0, "p90": 1.0, "p95": 1.0, "p99": 1.0, "std": 0.0}
    rec = {"schema": SCHEMA, "run_id": "a-1", "label": "a", "k": 2, "server_config": {"k": 2},
           "base_url": "http://127.0.0.1:1", "model": "m", "endpoint": "completions",
           "arrival": {"process": "poisson"}, "offered_rate": 1.0, "achieved_rate": 0.9, "duration_s": 10.0,
           "num_requests": 3, "num_completed": 3, "num_failed": 0, "mean_prompt_tokens": 10.0,
           "mean_output_tokens": 5.0, "e2e_s": stats, "ttft_s": stats, "tpot_s": stats, "itl_s": stats,
           "mean_in_flight": 0.9, "littles_law_in_flight": 0.9, "in_flight_slope": 0.0, "spec": None,
           "preemptions": None, "slo": None, "slo_attainment": None, "goodput_rps": None,
           "output_throughput_tps": 4.5, "requests_file": "x", "started_at": "2026-01-01T00:00:00+00:00"}
    rec.update(over)
    return rec


def test_validate():
    assert validate_run(minimal_record()) == []
    assert "missing label" in validate_run({k: v for k, v in minimal_record().items() if k != "label"})
    assert validate_run(minimal_record(num_completed=True)) == ["num_completed has type bool"]
    assert validate_run(minimal_record(schema="other/1"))
    assert set(RUN_KEYS) >= {"label", "k", "offered_rate", "achieved_rate", "e2e_s", "ttft_s", "tpot_s",
                             "mean_in_flight", "in_flight_slope", "spec", "preemptions",
                             "mean_prompt_tokens", "mean_output_tokens"}


def test_append_and_read_round_trip(tmp_path):
    path = tmp_path / "out" / "bench.jsonl"
    append_run(path, minimal_record(in_flight_slope=float("nan")), [{"id": 0, "e2e_s": 1.0}])
    append_run(path, minimal_record(run_id="a-2"), [{"id": 0, "e2e_s": 2.0}, {"id": 1, "e2e_s": 3.0}])
    runs = read_runs(path)
    assert [r["run_id"] for r in runs] == ["a-1", "a-2"]
    assert runs[0]["in_flight_slope"] is None                  # NaN is not JSON: written as null
    assert runs[0]["requests_file"] == "bench.requests.jsonl"
    rows = read_request_rows(path)
    assert [r["e2e_s"] for r in rows["a-2"]] == [2.0, 3.0] and len(rows["a-1"]) == 1
    for line in path.read_text().splitlines():
        json.loads(line)                                       # strict JSON, one object per line


def test_invalid_record_is_never_written(tmp_path):
    with pytest.raises(AssertionError):
        append_run(tmp_path / "r.jsonl", minimal_record(label=None), [])
    assert not (tmp_path / "r.jsonl").exists()


def test_read_errors(tmp_path):
    with pytest.raises(SpecServeError):
        read_runs(tmp_path / "missing.jsonl")
    p = tmp_path / "bad.jsonl"
    p.write_text('{"schema": "something/1"}\n')
    with pytest.raises(SpecServeError, match="not a specserve bench run"):
        read_runs(p)


def test_helpers():
    assert requests_path("runs/b.jsonl").name == "b.requests.jsonl"
    assert clean({"a": [math.inf, 1.0], "b": float("nan")}) == {"a": [None, 1.0], "b": None}
