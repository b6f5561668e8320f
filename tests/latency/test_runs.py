"""Reading bench records and deciding which runs are saturated."""
import numpy as np
import pytest

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import expected_tokens, positional_acceptance
from specserve.latency.records.runs import load_runs
from specserve.latency.records.saturation import SaturationRules, saturation_reasons
from synthetic import minimal_record, write_records


def _run(tmp_path, **overrides):
    return load_runs([write_records(tmp_path / "r.jsonl", minimal_record(**overrides))])[0]


def test_reads_a_record(tmp_path):
    run = _run(tmp_path)
    assert (run.label, run.k, run.acceptance_length, run.achieved_rate) == ("k2", 2, 2.5, 1.0)
    assert run.in_flight == pytest.approx(2.0)  # λ·L
    assert run.e2e.p99 == 4.0 and run.ttft.p95 is None
    assert run.run_key == "r1" and run.source.endswith("r.jsonl:1")


def test_arrival_cv_is_the_one_the_measured_requests_met(tmp_path):
    assert _run(tmp_path, arrival={"process": "poisson"}).cv == 1.0
    assert _run(tmp_path, arrival={"process": "poisson"}, arrival_gap_cv=1.4).cv == pytest.approx(1.4)
    assert _run(tmp_path, arrival={"process": "trace"}, arrival_gap_cv=0.7).cv == pytest.approx(0.7)


def test_k_and_acceptance_from_other_fields(tmp_path):
    run = _run(tmp_path, k=None, server_config={"num_speculative_tokens": 4},
               spec={"num_drafts": 10, "num_accepted_tokens": 20})
    assert (run.k, run.acceptance_length) == (4, 3.0)  # 1 + accepted/drafts
    run = _run(tmp_path, k=0, spec=None)
    assert run.acceptance_length == 1.0


def test_missing_information_names_the_fix(tmp_path):
    with pytest.raises(SpecServeError, match="--alpha k2=A"):
        _run(tmp_path, spec=None)
    with pytest.raises(SpecServeError, match="--k k2=K"):
        _run(tmp_path, k=None)
    path = write_records(tmp_path / "r.jsonl", minimal_record(spec=None, k=None))
    run = load_runs([path], k_overrides={"k2": 3}, alpha_overrides={"k2": 0.5})[0]
    assert run.acceptance_length == pytest.approx(expected_tokens(0.5, 3))


@pytest.mark.parametrize("overrides, message", [
    (dict(schema="other/1"), "schema"),
    (dict(label=""), "label"),
    (dict(achieved_rate=-1), "achieved_rate"),
    (dict(e2e_s={"mean": None}), "e2e_s"),
    (dict(spec={"mean_acceptance_length": 4.0}), r"\[1, k\+1\]"),  # E = 4 > k + 1 = 3
])
def test_bad_records_are_clear_errors(tmp_path, overrides, message):
    with pytest.raises(SpecServeError, match=message):
        _run(tmp_path, **overrides)


def test_file_level_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": "specserve.bench.run/1"\n')
    with pytest.raises(SpecServeError, match=r"bad.jsonl:1: not JSON"):
        load_runs([bad])
    with pytest.raises(SpecServeError, match="cannot read"):
        load_runs([tmp_path / "missing.jsonl"])
    two = write_records(tmp_path / "two.jsonl", minimal_record(), minimal_record(k=4))
    with pytest.raises(SpecServeError, match="own label"):
        load_runs([two])


def test_runs_without_completions_are_reported_not_fitted(tmp_path):
    path = write_records(tmp_path / "r.jsonl", minimal_record(), minimal_record(
        num_completed=0, e2e_s={"mean": None}, mean_output_tokens=None))
    unusable = []
    runs = load_runs([path], unusable=unusable)
    assert len(runs) == 1 and unusable[0]["reasons"] == ["no request completed"]


def test_positional_acceptance_from_counts():
    assert positional_acceptance(100, [80, 40, 10]) == pytest.approx([0.8, 0.5, 0.25])
    assert positional_acceptance(100, [0, 0]) == [0.0, 0.0]
    assert positional_acceptance(0, [1]) is None
    assert positional_acceptance(100, [160, -160]) is None  # impossible counts: no positional view


RULES = SaturationRules()


def test_stable_run_is_kept(tmp_path):
    assert saturation_reasons(_run(tmp_path, arrival_rate=1.02), RULES) == []
    # offered-only comparison tolerates the Poisson noise of 100 arrivals (3/√100 = 30%)
    assert saturation_reasons(_run(tmp_path, offered_rate=1.25), RULES) == []


@pytest.mark.parametrize("overrides, word", [
    (dict(arrival_rate=1.3), "arrived"),
    (dict(offered_rate=1.6), "offered"),
    (dict(in_flight_slope=0.05), "grew"),  # 5 requests more over 100 s, mean 2 in flight
    (dict(preemptions=3), "preemptions"),
    (dict(achieved_rate=3.0), "Little's law"),  # 3 req/s x 2 s = 6 in flight, but 2 measured
    (dict(num_failed=5), "failed"),
])
def test_each_saturation_symptom_excludes(tmp_path, overrides, word):
    reasons = saturation_reasons(_run(tmp_path, **overrides), RULES)
    assert len(reasons) == 1 and word in reasons[0]


def test_rules_validate_and_loosen(tmp_path):
    with pytest.raises(SpecServeError):
        SaturationRules(rate_tolerance=1.5)
    with pytest.raises(SpecServeError):
        SaturationRules(growth_tolerance=-1)
    loose = SaturationRules(growth_tolerance=10.0)
    assert saturation_reasons(_run(tmp_path, in_flight_slope=0.05), loose) == []
    with pytest.raises(SpecServeError):
        SaturationRules(littles_law_tolerance=-0.1)
    assert saturation_reasons(_run(tmp_path, achieved_rate=3.0), SaturationRules(littles_law_tolerance=5.0)) == []


def test_burst_runs_are_never_fitted(tmp_path):
    reasons = saturation_reasons(_run(tmp_path, arrival={"process": "burst"}, offered_rate=None), RULES)
    assert reasons == ["burst arrivals (all at once) have no steady state"]


def test_shared_request_file_is_split_by_run(tmp_path):
    import json

    from specserve.latency.records.requests import load_request_samples

    rows = [{"run": run, "id": i, "measured": i > 0, "prompt_tokens": None, "est_prompt_tokens": 100 + i,
             "output_tokens": 10 * n, "ttft_s": 0.1, "error": None}
            for n, run in enumerate(("a", "b"), start=1) for i in range(4)]
    rows.append({"run": "a", "id": 9, "prompt_tokens": 5, "output_tokens": 1, "ttft_s": 1.0, "error": "timeout"})
    (tmp_path / "r.requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write_records(tmp_path / "r.jsonl",
                         *(minimal_record(run_id=run, label=run, requests_file="r.requests.jsonl") for run in "ab"),
                         minimal_record(run_id=None, label="c", requests_file="r.requests.jsonl"))
    samples, notes = load_request_samples(load_runs([path]))
    a, b = samples[f"{path}:1"], samples[f"{path}:2"]
    # warm-up (measured false) and failed rows dropped; the client's estimate stands in for usage
    assert list(a.prompt_tokens) == [101, 102, 103] and set(a.output_tokens) == {10}
    assert set(b.output_tokens) == {20}
    assert f"{path}:3" not in samples and "names none" in notes[0]


def test_e2e_noise_is_the_spread_lengths_do_not_explain():
    from specserve.latency.records.requests import RequestSample

    g = np.array([20.0, 60.0, 100.0, 300.0, 500.0, 40.0])
    noise = np.array([0.1, -0.1, 0.1, -0.1, 0.1, -0.1])
    e2e = 0.5 + 0.03 * g + noise
    ones = np.ones(6)
    sample = RequestSample(100 * ones, g, ones, e2e)
    # The raw spread is mostly the lengths' (std ~5.6 s); what remains after the line is the noise.
    residual = e2e - np.polyval(np.polyfit(g, e2e, 1), g)
    assert sample.e2e_noise_std() == pytest.approx(np.sqrt(residual @ residual / 4))
    assert sample.e2e_noise_std() < 0.15 < 5 < e2e.std()
    # One output length (fixed-length workloads), too few requests, or no E2E: no estimate.
    assert RequestSample(100 * ones, 128 * ones, ones, e2e).e2e_noise_std() is None
    assert RequestSample(ones[:3], g[:3], ones[:3], e2e[:3]).e2e_noise_std() is None
    assert RequestSample(100 * ones, g, ones, np.full(6, np.nan)).e2e_noise_std() is None


def test_lifetime_company_counts_overlaps_including_warmup_requests():
    from specserve.latency.records.requests import lifetime_company
    rows = [  # a warm-up request, then three measured ones; the last overlaps nobody
        {"sent_s": 0.0, "end_s": 4.0, "measured": False},
        {"sent_s": 2.0, "end_s": 6.0, "measured": True},   # shares 2 s with the first and 3 s with the next
        {"sent_s": 3.0, "end_s": 7.0, "measured": True},   # 1 s with the first, 3 s with the second
        {"sent_s": 10.0, "end_s": 12.0, "measured": True},
        {"sent_s": 3.0, "end_s": 9.0, "error": "timeout"},  # failed requests are no company
    ]
    # pooled over the measured lifetimes (4 + 4 + 2 s), as the latency model weighs company
    assert lifetime_company(rows) == pytest.approx((2 + 3 + 1 + 3 + 0) / (4 + 4 + 2))
    assert lifetime_company([{"sent_s": 0.0, "end_s": 1.0, "measured": False}]) is None
    assert lifetime_company([{"measured": True}]) is None
