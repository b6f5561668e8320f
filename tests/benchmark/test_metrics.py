import math

import numpy as np
import pytest

from specserve.benchmark import metrics
from specserve.benchmark.client import RequestResult
from specserve.benchmark.server_metrics import delta, parse_prometheus
from specserve.benchmark.summary import build_record


def test_percentiles_hand_computed():
    s = metrics.summarize([4.0, 1.0, 3.0, 2.0])
    # Linear interpolation between order statistics 1,2,3,4: p90 sits at rank 0.9·3 = 2.7 -> 3.7.
    assert s["mean"] == 2.5 and s["median"] == 2.5
    assert s["p90"] == pytest.approx(3.7) and s["p95"] == pytest.approx(3.85)
    assert s["p99"] == pytest.approx(3.97) and s["std"] == pytest.approx(math.sqrt(1.25))
    assert metrics.summarize([]) == {k: None for k in metrics.STAT_KEYS}
    assert metrics.summarize([None, 2.0])["p99"] == 2.0


def test_tpot_definition():
    assert metrics.tpot(1.0, 0.1, 10) == pytest.approx(0.1)    # 0.9 s over the 9 tokens after the first
    assert metrics.tpot(0.5, 0.5, 1) is None
    assert metrics.tpot(0.5, 0.1, None) is None


def test_parse_slo():
    assert metrics.parse_slo("ttft:500 tpot:50,e2e:8000") == {"ttft_ms": 500, "tpot_ms": 50, "e2e_ms": 8000}
    assert metrics.parse_slo(None) is None
    for bad in ("ttft=500", "latency:3", "tpot:-1", "ttft:"):
        with pytest.raises(ValueError):
            metrics.parse_slo(bad)


def test_meets_slo_bounds_are_inclusive_and_one_token_tpot_is_zero():
    slo = {"ttft_ms": 200, "tpot_ms": 100}
    assert metrics.meets_slo(True, 0.2, 0.1, 5.0, slo)
    assert not metrics.meets_slo(True, 0.2001, 0.1, 5.0, slo)
    assert metrics.meets_slo(True, 0.1, None, 5.0, slo)
    assert not metrics.meets_slo(False, 0.1, 0.01, 0.2, slo)
    assert not metrics.meets_slo(True, 0.1, 0.01, 9.0, {"e2e_ms": 8000})


def _req(i, sent, ttft, e2e, out, error=None, measured=True):
    r = RequestResult(id=i, arrival_s=sent, measured=measured, est_prompt_tokens=10, max_tokens=out)
    r.sent_s, r.end_s = sent, sent + e2e
    if error is None:
        r.first_token_s = sent + ttft
        r.output_tokens = out
        # Chunks evenly spaced after the first token.
        r.chunk_times = list(np.linspace(sent + ttft, sent + e2e, out)) if out > 1 else [sent + ttft]
    else:
        r.error = error
    return r


def test_goodput_and_attainment_hand_computed():
    results = [
        _req(0, 0.0, 0.1, 1.0, 10),          # TPOT 0.1: meets both
        _req(1, 1.0, 0.3, 1.2, 10),          # TTFT 300 ms > 200: misses
        _req(2, 2.0, 0.1, 2.0, 11),          # TPOT 0.19 > 0.15: misses
        _req(3, 3.0, 0.0, 0.5, 0, error="HTTP 500: boom"),   # failed: misses
        _req(4, 4.0, 0.1, 0.1, 1),           # one token: TPOT counts as 0, meets
        _req(5, 5.0, 5.0, 5.0, 1, measured=False),           # discarded warm-up: ignored
    ]
    rec = build_record(results, run_id="r", label="x", k=None, server_config={}, base_url="u", model="m",
                       endpoint="completions", arrival={}, offered_rate=1.0,
                       slo={"ttft_ms": 200, "tpot_ms": 150}, server_delta=None, prompt_info={},
                       started_at="t")
    assert rec["num_requests"] == 5 and rec["num_completed"] == 4 and rec["num_failed"] == 1
    assert rec["slo_attainment"] == pytest.approx(2 / 5)
    # Measured span: first send 0 s to last end 4.1 s (request 2 ends at 4.0, request 4 at 4.1).
    assert rec["bench_duration_s"] == pytest.approx(4.1)
    assert rec["goodput_rps"] == pytest.approx(2 / 4.1)
    assert rec["request_throughput_rps"] == pytest.approx(4 / 4.1)
    assert rec["tpot_s"]["mean"] == pytest.approx((0.1 + 0.1 + 0.19) / 3)
    assert rec["ttft_s"]["median"] == pytest.approx(0.1)
    assert rec["errors"] == {"HTTP 500: boom": 1}
    assert rec["mean_output_tokens"] == pytest.approx((10 + 10 + 11 + 1) / 4)
    assert rec["arrival_gap_cv"] is None  # 4 gaps between the measured arrivals: too few to say


def test_gap_cv():
    assert metrics.gap_cv(np.arange(10.0)) == pytest.approx(0.0)  # regular
    assert metrics.gap_cv(np.cumsum([0, 1, 3, 1, 3, 1, 3])) == pytest.approx(0.5)  # gaps 1, 3: std 1, mean 2
    assert metrics.gap_cv(np.arange(5.0)) is None and metrics.gap_cv(np.zeros(20)) is None
    gaps = np.random.default_rng(0).exponential(size=20_000)
    assert metrics.gap_cv(np.cumsum(gaps)) == pytest.approx(1.0, abs=0.03)  # Poisson


def test_in_flight_average_and_slope_exact():
    # n(t) = 1 on [0,1), 2 on [1,2), 1 on [2,3): mean 4/3, symmetric so slope 0.
    assert metrics.in_flight_stats([(0, 2), (1, 3)], 0, 3) == pytest.approx((4 / 3, 0.0))
    # n(t) = 1, 2, 3 on unit steps: least-squares slope of the step function is 8/9 per second.
    mean, slope = metrics.in_flight_stats([(0, 3), (1, 3), (2, 3)], 0, 3)
    assert mean == pytest.approx(2.0) and slope == pytest.approx(8 / 9)
    # The window cuts intervals: only [1, 2] of request (0, 3) counts.
    assert metrics.in_flight_stats([(0, 3)], 1, 2) == pytest.approx((1.0, 0.0))


def test_achieved_rate():
    # Open loop, one request per second, each 0.5 s long: departures are 1 s apart -> 1 req/s, although
    # first send to last end is 3.5 s for 4 requests.
    a = np.array([0.0, 1.0, 2.0, 3.0])
    assert metrics.achieved_rate(a, a, a + 0.5) == pytest.approx(1.0)
    # Closed loop (all arrive at 0): completions / (last end - first send).
    assert metrics.achieved_rate(np.zeros(4), np.array([0, 0, 0.5, 1.0]),
                                 np.array([0.5, 1.0, 1.5, 2.0])) == pytest.approx(2.0)
    assert metrics.achieved_rate(a, a, np.array([])) == 0.0


def test_measurement_window():
    assert metrics.measurement_window(np.array([0.0, 1.0, 4.0]), np.array([1.0, 2.0, 5.0])) == (0.0, 4.0, False)
    # A burst: sends all within 1 % of the span -> the whole span.
    assert metrics.measurement_window(np.array([0.0, 0.01]), np.array([1.0, 2.0])) == (0.0, 2.0, True)


def test_spec_totals():
    s = metrics.spec_totals([{"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 8,
                              "accepted_per_position": [4, 3, 1, 0]},
                             {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 4,
                              "accepted_per_position": [2, 2]}])
    assert s["acceptance_rate"] == pytest.approx(12 / 24)
    assert s["mean_acceptance_length"] == pytest.approx(1 + 12 / 6)
    assert s["accepted_per_position"] == [6, 5, 1, 0]
    assert metrics.spec_totals([]) is None


def test_prometheus_counters():
    text = """# HELP vllm:num_preemptions_total Preemptions
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{model_name="a",engine="0"} 3.0
vllm:num_preemptions_total{model_name="a",engine="1"} 2.0
vllm:num_preemptions_created{model_name="a"} 1.7e9
vllm:spec_decode_num_drafts_total{model_name="a"} 10
specserve:spec_decode_num_accepted_tokens_total 7
other_metric 5
"""
    c = parse_prometheus(text)
    assert c == {"preemptions": 5.0, "spec_drafts": 10.0, "spec_accepted_tokens": 7.0}
    assert delta({"preemptions": 1.0}, c)["preemptions"] == 4.0
    assert delta(None, c) is None


def test_server_metrics_read_specserve_policy_series_by_label():
    from specserve.benchmark.server_metrics import delta, parse_prometheus
    from specserve.benchmark.summary import _policy
    text = """
specserve:spec_decode_policy_info{model_name="m",policy="adaptive"} 1.0
specserve:spec_decode_draft_length_sum{model_name="m"} 30.0
specserve:spec_decode_draft_length_count{model_name="m"} 20.0
specserve:spec_decode_step_time_seconds_sum{kind="measured",model_name="m"} 2.0
specserve:spec_decode_step_time_seconds_count{kind="measured",model_name="m"} 10.0
specserve:spec_decode_step_time_seconds_sum{kind="predicted",model_name="m"} 2.2
specserve:spec_decode_step_time_seconds_count{kind="predicted",model_name="m"} 10.0
specserve:slo_requests_total{met="true",model_name="m",objective="tpot"} 7.0
specserve:slo_requests_total{met="false",model_name="m",objective="tpot"} 1.0
specserve:spec_decode_cost_model_relative_error{model_name="m"} 0.04
"""
    after = parse_prometheus(text)
    assert after["policy"] == "adaptive" and after["slo_tpot_met"] == 7 and after["slo_tpot_missed"] == 1
    before = {"draft_length_sum": 10.0, "draft_length_count": 10.0, "cost_model_relative_error": 0.5}
    d = delta(before, after)
    assert d["draft_length_sum"] == 20 and d["cost_model_relative_error"] == 0.04 and d["policy"] == "adaptive"
    policy = _policy(d)
    assert policy["name"] == "adaptive" and policy["mean_draft_length"] == 2.0
    assert policy["mean_predicted_step_time_s"] == pytest.approx(0.22) and _policy({"spec_drafts": 3}) is None
