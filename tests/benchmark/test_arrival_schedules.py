import json
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats

from specserve.benchmark import arrival_schedules as arr
from specserve.errors import SpecServeError


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_azure_timestamps_keep_all_seven_fractional_digits(tmp_path):
    p = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n"
              "2023-11-16 18:15:50.9951691,396,109\n"
              "2023-11-16 18:15:50.9951692,10,2\n")
    t = arr.load_trace(str(p))
    assert t.format == "azure"
    # 4.3145791 s and then 100 ns more: float epoch seconds could not tell these apart.
    assert t.times_s[1] == pytest.approx(4.3145791, abs=1e-9)
    assert t.times_s[2] - t.times_s[1] == pytest.approx(1e-7, abs=2e-9)
    assert t.input_tokens.tolist() == [374, 396, 10]
    assert t.output_tokens.tolist() == [44, 109, 2]


def test_timestamp_formats():
    base = arr.parse_timestamp_ns("2023-11-16 18:17:03.9799600")
    assert arr.parse_timestamp_ns("2023-11-16 18:17:04.0000000") - base == 20_040_000
    assert arr.parse_timestamp_ns("2023-11-16T18:17:03.97996") == base
    # The 2024 week-long traces carry an offset and 6 digits; +01:00 is one hour earlier in UTC.
    utc = arr.parse_timestamp_ns("2024-05-10 00:00:00.009930+00:00")
    assert arr.parse_timestamp_ns("2024-05-10 01:00:00.009930+01:00") == utc
    assert arr.parse_timestamp_ns("2024-05-10 00:00:00.009930Z") == utc
    assert arr.parse_timestamp_ns("12.5") == 12_500_000_000
    with pytest.raises(SpecServeError):
        arr.parse_timestamp_ns("yesterday")


def test_shipped_azure_conv_trace():
    t = arr.load_trace("azure-conv")
    assert len(t) == 19366
    assert t.times_s[0] == 0.0 and np.all(np.diff(t.times_s) >= 0)
    # First row 18:15:46.6805900, last 19:14:08.4025270 (SOURCES.md).
    assert t.times_s[-1] == pytest.approx(3501.721937, abs=1e-6)
    assert 5.0 < t.mean_rate < 6.0
    assert t.output_tokens.min() > 0 and t.input_tokens.max() == 14050


def test_mooncake_jsonl_timestamps_are_milliseconds(tmp_path):
    rows = [{"timestamp": 3052, "input_length": 7234, "output_length": 794, "hash_ids": [0, 28]},
            {"timestamp": 0, "input_length": 6755, "output_length": 500, "hash_ids": [0, 1, 2]},
            {"timestamp": 0, "input_length": 7319, "output_length": 490, "hash_ids": [0, 14]},
            {"timestamp": 10535, "input_length": 2287, "output_length": 316, "hash_ids": [0, 42]}]
    p = write(tmp_path, "m.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n")
    t = arr.load_trace(str(p))
    assert t.format == "mooncake"
    assert t.times_s.tolist() == [0.0, 0.0, 3.052, 10.535]          # sorted, stable for ties
    assert t.input_tokens.tolist() == [6755, 7319, 7234, 2287]
    assert t.hash_ids[0] == [0, 1, 2] and t.hash_ids[2] == [0, 28]


def test_one_column_timestamp_csv(tmp_path):
    t = arr.load_trace(str(write(tmp_path, "a.csv", "timestamp\n10.5\n11.25\n13\n")))
    assert t.times_s.tolist() == [0.0, 0.75, 2.5] and t.input_tokens is None
    t = arr.load_trace(str(write(tmp_path, "b.csv", "3\n1\n2\n")))            # no header, unsorted
    assert t.times_s.tolist() == [0.0, 1.0, 2.0]
    t = arr.load_trace(str(write(tmp_path, "c.csv", "2023-11-16 18:15:46.68\n2023-11-16 18:15:47.18\n")))
    assert t.times_s.tolist() == [0.0, 0.5]


def test_timestamps_format_drops_lengths_and_bad_rows_fail(tmp_path):
    p = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.00,374,44\n2023-11-16 18:15:47.00,396,109\n")
    assert arr.load_trace(str(p), "timestamps").input_tokens is None
    bad = write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.00,374\n")
    with pytest.raises(SpecServeError, match="bad.csv:2"):
        arr.load_trace(str(bad))
    with pytest.raises(SpecServeError):
        arr.load_trace(str(tmp_path / "missing.csv"))


def test_window_start_duration_scale_max_requests():
    t = arr.Trace(np.arange(6, dtype=float), np.arange(6) * 10, np.arange(6) + 1)
    w = arr.window(t, start_s=1.0, duration_s=3.0, time_scale=2.0)
    assert w.times_s.tolist() == [0.0, 2.0, 4.0]          # trace seconds 1, 2, 3, doubled
    assert w.input_tokens.tolist() == [10, 20, 30]
    w = arr.window(t, start_s=0.5, duration_s=3.0, time_scale=0.5, max_requests=2)
    assert w.times_s.tolist() == [0.25, 0.75]             # the window starts at 0.5, not at a request
    with pytest.raises(SpecServeError):
        arr.window(t, start_s=10.0)
    with pytest.raises(SpecServeError):
        arr.window(t, time_scale=0.0)


def test_a_scaled_trace_sweep_run_arrives_at_the_target_rate(tmp_path):
    """`bench sweep --scale-trace`: each run replays rate x --duration requests from --start, scaled to
    arrive at the rate on average, whatever the trace's own rate there (this one is sparse for its first
    50 s and dense after: scaling by its overall mean rate replayed a handful of requests)."""
    from specserve.benchmark.sweep import _spec_at_rate
    from specserve.benchmark.workload import WorkloadSpec, make_workload
    stamps = [10.0 * i for i in range(6)] + [50.0 + 0.1 * i for i in range(1, 400)]
    trace = write(tmp_path, "t.csv", "\n".join(map(str, stamps)) + "\n")
    spec = WorkloadSpec(trace=str(trace), trace_format="timestamps", duration_s=20.0, input_len=8, output_len=4)
    for rate, start in ((2.0, 0.0), (0.5, 55.0)):
        run = _spec_at_rate(replace(spec, start_s=start), rate, scale_trace=True)
        times = make_workload(run).arrival_s
        assert len(times) == rate * 20.0
        assert (len(times) - 1) / (times[-1] - times[0]) == pytest.approx(rate)
    capped = _spec_at_rate(replace(spec, max_requests=10), 2.0, scale_trace=True)
    assert len(make_workload(capped).arrival_s) == 10


def test_poisson_statistics():
    rng = np.random.default_rng(1234)
    times = arr.synthetic_arrivals(8.0, rng, n=20000)
    gaps = np.diff(times)
    assert times[0] == 0.0
    assert 1 / gaps.mean() == pytest.approx(8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)
    assert stats.kstest(gaps, "expon", args=(0, 1 / 8.0)).pvalue > 0.01
    # Counts per 1 s window of a Poisson process: variance equals the mean.
    counts = np.histogram(times, bins=np.arange(0, int(times[-1])))[0]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_statistics(cv):
    rng = np.random.default_rng(99)
    gaps = np.diff(arr.synthetic_arrivals(4.0, rng, n=40000, cv=cv))
    assert 1 / gaps.mean() == pytest.approx(4.0, rel=0.04)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)
    shape = 1 / cv ** 2
    assert stats.kstest(gaps, "gamma", args=(shape, 0, 1 / (4.0 * shape))).pvalue > 0.01


def test_synthetic_by_duration_and_seeding():
    a = arr.synthetic_arrivals(50.0, np.random.default_rng(7), duration_s=20.0)
    b = arr.synthetic_arrivals(50.0, np.random.default_rng(7), duration_s=20.0)
    assert np.array_equal(a, b)
    assert a.max() < 20.0 and abs(len(a) - 1000) < 5 * np.sqrt(1000)
    assert not np.array_equal(a[:50], arr.synthetic_arrivals(50.0, np.random.default_rng(8), n=50))
    assert np.all(arr.synthetic_arrivals(float("inf"), np.random.default_rng(0), n=5) == 0)
