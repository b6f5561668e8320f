"""Turns one run's request results into its results line (run record) and per-request rows."""
from __future__ import annotations

from collections import Counter

import numpy as np

from specserve.benchmark import metrics
from specserve.benchmark.client import RequestResult
from specserve.benchmark.results import SCHEMA


def _r6(x):
    return None if x is None else round(float(x), 6)


def request_row(r: RequestResult) -> dict:
    ttft, e2e = r.ttft_s, r.e2e_s
    return {"id": r.id, "measured": r.measured, "arrival_s": _r6(r.arrival_s), "sent_s": _r6(r.sent_s),
            "first_token_s": _r6(r.first_token_s), "end_s": _r6(r.end_s),
            "prompt_tokens": r.prompt_tokens, "est_prompt_tokens": r.est_prompt_tokens,
            "target_prompt_tokens": r.target_prompt_tokens, "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens, "output_tokens_source": r.output_tokens_source,
            "ttft_s": _r6(ttft), "e2e_s": _r6(e2e),
            "tpot_s": _r6(metrics.tpot(e2e, ttft, r.output_tokens)) if r.ok else None,
            "itl_s": [_r6(g) for g in r.itl_s], "num_chunks": len(r.chunk_times),
            "spec": r.spec, "error": r.error}


def _spec(ok: list[RequestResult], server_delta: dict | None) -> dict | None:
    """Speculation totals: from the responses when they count drafts (specserve), else from the server's
    /metrics counter deltas (vLLM, llama-server). llama-server's responses count drafted and accepted
    tokens but not drafts, so the acceptance length needs /metrics; without it their rate is kept."""
    from_responses = metrics.spec_totals([r.spec for r in ok if r.spec])
    if from_responses is not None and from_responses["num_drafts"]:
        return from_responses
    d = server_delta or {}
    if d.get("spec_drafts"):
        summary = metrics.spec_summary(d["spec_drafts"], d.get("spec_draft_tokens", 0),
                                       d.get("spec_accepted_tokens", 0), d.get("accepted_per_position"),
                                       "metrics")
        if from_responses is not None:   # the measured requests' own rate, beside the server-wide one
            summary["responses_acceptance_rate"] = from_responses["acceptance_rate"]
        return summary
    return from_responses


def _policy(server_delta: dict | None) -> dict | None:
    """What a specserve server's speculation policy did during the run (None for other servers)."""
    d = server_delta or {}
    if d.get("policy") is None:
        return None
    mean = lambda total, count: d[total] / d[count] if d.get(count) else None  # noqa: E731
    return {"name": d["policy"],
            "mean_draft_length": mean("draft_length_sum", "draft_length_count"),  # per request and step
            "mean_step_draft_length": mean("step_draft_length_sum", "step_draft_length_count"),
            "mean_step_time_s": mean("step_time_measured_s", "step_time_measured_count"),
            "mean_predicted_step_time_s": mean("step_time_predicted_s", "step_time_predicted_count"),
            "cost_model_relative_error": d.get("cost_model_relative_error"),
            "acceptance_calibration_error": d.get("acceptance_calibration_error"),
            "drafting_cost_factor": d.get("drafting_cost_factor")}


def build_record(results: list[RequestResult], *, run_id: str, label: str, k: int | None,
                 server_config: dict, base_url: str, model: str, endpoint: str, arrival: dict,
                 offered_rate: float | None, slo: dict | None, server_delta: dict | None,
                 prompt_info: dict, started_at: str) -> dict:
    measured = [r for r in results if r.measured and r.done]
    ok = [r for r in measured if r.ok]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok]
    tpots = [metrics.tpot(r.e2e_s, r.ttft_s, r.output_tokens) for r in ok]
    itl = [g for r in ok for g in r.itl_s]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    chunks = sum(len(r.chunk_times) for r in ok)

    record: dict = {
        "schema": SCHEMA, "run_id": run_id, "label": label, "k": k, "server_config": server_config,
        "base_url": base_url, "model": model, "endpoint": endpoint, "arrival": arrival,
        "offered_rate": offered_rate, "num_requests": len(measured), "num_completed": len(ok),
        "num_failed": len(measured) - len(ok), "started_at": started_at,
        "e2e_s": metrics.summarize(e2e), "ttft_s": metrics.summarize(ttft),
        "tpot_s": metrics.summarize(tpots), "itl_s": metrics.summarize(itl),
        "tokens_per_chunk": out_tokens / chunks if chunks else None,
        # Send time minus scheduled arrival: waiting for a --max-concurrency slot, or the client itself
        # falling behind its schedule (which would make the offered load a fiction).
        "send_delay_s": metrics.summarize([r.sent_s - r.arrival_s for r in measured]),
        "slo": slo, "prompts": prompt_info,
        "errors": dict(Counter(r.error for r in measured if r.error).most_common(5)),
    }
    server_prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    record["mean_prompt_tokens"] = (float(np.mean(server_prompt)) if server_prompt else
                                    float(np.mean([r.est_prompt_tokens for r in ok])) if ok else None)
    record["prompt_tokens_source"] = ("server" if server_prompt and len(server_prompt) == len(ok)
                                      else prompt_info.get("counting", "estimate"))
    record["mean_output_tokens"] = out_tokens / len(ok) if ok else None
    record["output_tokens_source"] = ("usage" if all(r.output_tokens_source == "usage" for r in ok)
                                      else "chunks")

    if measured:
        sent = np.array([r.sent_s for r in measured])
        arrivals = np.array(sorted(r.arrival_s for r in measured))
        ok_ends = np.array([r.end_s for r in ok])
        t0, t1, whole_span = metrics.measurement_window(sent, np.array([r.end_s for r in measured]))
        # Failed and discarded requests occupied the server too: count every sent request in flight.
        intervals = [(r.sent_s, r.end_s) for r in results if r.done]
        mean_b, slope = metrics.in_flight_stats(intervals, t0, t1)
        achieved = metrics.achieved_rate(arrivals, sent, ok_ends)
        bench_span = float(max(r.end_s for r in measured) - sent.min())
        arrival_span = float(arrivals[-1] - arrivals[0])
        record.update({
            "window_s": [t0, t1], "window_is_whole_span": whole_span,
            "duration_s": t1 - t0, "bench_duration_s": bench_span,
            "achieved_rate": achieved,
            "arrival_rate": (len(arrivals) - 1) / arrival_span if arrival_span > 0 else None,
            "arrival_gap_cv": metrics.gap_cv(arrivals),
            "request_throughput_rps": len(ok) / bench_span if bench_span > 0 else 0.0,
            "output_throughput_tps": out_tokens / bench_span if bench_span > 0 else 0.0,
            "mean_in_flight": mean_b, "in_flight_slope": slope,
            "littles_law_in_flight": achieved * float(np.mean(e2e)) if ok else None,
        })
    else:
        record.update({"window_s": None, "window_is_whole_span": None, "duration_s": 0.0,
                       "bench_duration_s": 0.0, "achieved_rate": 0.0, "arrival_rate": None, "arrival_gap_cv": None,
                       "request_throughput_rps": 0.0, "output_throughput_tps": 0.0,
                       "mean_in_flight": None, "in_flight_slope": None, "littles_law_in_flight": None})

    if slo:
        good = sum(metrics.meets_slo(r.ok, r.ttft_s, t, r.e2e_s, slo)
                   for r, t in zip(ok, tpots))
        record["slo_attainment"] = good / len(measured) if measured else None
        span = record["bench_duration_s"]
        record["goodput_rps"] = good / span if span > 0 else 0.0
    else:
        record["slo_attainment"] = record["goodput_rps"] = None

    record["spec"] = _spec(ok, server_delta)
    record["server_metrics"] = server_delta
    record["policy"] = _policy(server_delta)
    pre = (server_delta or {}).get("preemptions")
    record["preemptions"] = int(round(pre)) if pre is not None else None
    queries = (server_delta or {}).get("prefix_cache_queries")
    record["prefix_cache_hit_rate"] = server_delta["prefix_cache_hits"] / queries if queries else None
    return record
