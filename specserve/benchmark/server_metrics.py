"""Counters scraped from the server's Prometheus `/metrics` before and after a run (when it has one).

Preemptions and speculative-decoding totals are server-side facts the client cannot see; vLLM,
specserve and llama.cpp's `llama-server --metrics` name them alike (docs/server.md#metrics), with a
`vllm:`, `specserve:` or `llamacpp:` prefix. specserve also reports its speculation policy: chosen draft
lengths, predicted and measured step times, SLO attainment. llama-server also reports how many of its
fixed slots each decode call batched (a running average since start, turned into the run's own mean
with its decode-call counter) and how many requests waited for a slot.
"""
from __future__ import annotations

import re

import httpx

from specserve.benchmark.client import server_root

PREFIXES = ("specserve:", "vllm:", "llamacpp:")
# key -> (metric name after the prefix, labels the series must carry): summed over matching series
COUNTERS = {
    "preemptions": ("num_preemptions_total", {}),
    "prefix_cache_queries": ("prefix_cache_queries_total", {}),  # prompt tokens; vLLM names them alike
    "prefix_cache_hits": ("prefix_cache_hits_total", {}),
    "spec_drafts": ("spec_decode_num_drafts_total", {}),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens_total", {}),
    "spec_accepted_tokens": ("spec_decode_num_accepted_tokens_total", {}),
    # specserve's speculation policy at work (docs/server.md#metrics)
    "draft_length_sum": ("spec_decode_draft_length_sum", {}),
    "draft_length_count": ("spec_decode_draft_length_count", {}),
    "step_draft_length_sum": ("spec_decode_step_draft_length_sum", {}),
    "step_draft_length_count": ("spec_decode_step_draft_length_count", {}),
    "step_time_measured_s": ("spec_decode_step_time_seconds_sum", {"kind": "measured"}),
    "step_time_predicted_s": ("spec_decode_step_time_seconds_sum", {"kind": "predicted"}),
    "step_time_measured_count": ("spec_decode_step_time_seconds_count", {"kind": "measured"}),
    "step_time_predicted_count": ("spec_decode_step_time_seconds_count", {"kind": "predicted"}),
    "slo_ttft_met": ("slo_requests_total", {"objective": "ttft", "met": "true"}),
    "slo_ttft_missed": ("slo_requests_total", {"objective": "ttft", "met": "false"}),
    "slo_tpot_met": ("slo_requests_total", {"objective": "tpot", "met": "true"}),
    "slo_tpot_missed": ("slo_requests_total", {"objective": "tpot", "met": "false"}),
    # llama-server: decode calls (its batched steps, speculation's verify passes excluded)
    "decode_calls": ("n_decode_total", {}),
}
# Accepted tokens per draft position: one series per position label (0-based), summed per position.
# vLLM names it without `_total` in its text format, llama-server with it.
PER_POSITION = ("spec_decode_num_accepted_tokens_per_pos_total", "spec_decode_num_accepted_tokens_per_pos")
# Point-in-time values, reported as read after the run (not as a difference)
GAUGES = {
    "cost_model_relative_error": "spec_decode_cost_model_relative_error",
    "acceptance_calibration_error": "spec_decode_acceptance_calibration_error",
    "drafting_cost_factor": "spec_decode_drafting_cost_factor",
    "requests_deferred": "requests_deferred",               # llama-server: requests waiting for a slot
    "busy_slots_per_decode": "n_busy_slots_per_decode",     # llama-server: average since start
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_prometheus(text: str) -> dict:
    """Our counters and gauges from Prometheus text format, counters summed over matching label sets (e.g.
    one series per model); "policy": the speculation policy a specserve server names."""
    totals: dict = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        name = name[len(prefix):]
        if name == "spec_decode_policy_info":
            totals["policy"] = labels.get("policy")
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if name in PER_POSITION and labels.get("position", "").isdigit():
            per_pos = totals.setdefault("accepted_per_position", {})
            per_pos[int(labels["position"])] = per_pos.get(int(labels["position"]), 0.0) + number
            continue
        for key, (suffix, want) in COUNTERS.items():
            if name == suffix and all(labels.get(k) == v for k, v in want.items()):
                totals[key] = totals.get(key, 0.0) + number
        for key, gauge in GAUGES.items():
            if name == gauge:
                totals[key] = number
    return totals


async def scrape(http: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The counters now, or None when the server has no /metrics (llama.cpp without --metrics, APIs)."""
    try:
        resp = await http.get(server_root(base_url) + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    return parse_prometheus(resp.text)


def delta(before: dict | None, after: dict | None) -> dict | None:
    """How much each counter grew during the run, gauges and the policy as they were after it; None when
    either scrape failed. Per-position acceptance becomes a list (position 0 first); llama-server's
    busy slots per decode, an average since the server started, becomes the run's own average."""
    if before is None or after is None:
        return None
    out = {}
    for k, v in after.items():
        if k == "accepted_per_position":
            old = before.get(k) or {}
            out[k] = [v.get(i, 0.0) - old.get(i, 0.0) for i in range(max(v) + 1)] if v else None
        elif k in GAUGES or k == "policy":
            out[k] = v
        else:
            out[k] = v - before.get(k, 0.0)
    calls = out.get("decode_calls")
    if "busy_slots_per_decode" in after and not calls:
        out["busy_slots_per_decode"] = None   # no decode call during the run: no average of its own
    elif "busy_slots_per_decode" in after:
        # average x count = total, before and after: the run's total over the run's decode calls
        total = (after["busy_slots_per_decode"] * after.get("decode_calls", 0.0)
                 - before.get("busy_slots_per_decode", 0.0) * before.get("decode_calls", 0.0))
        out["busy_slots_per_decode"] = total / calls
    return out
