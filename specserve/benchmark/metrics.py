"""Latency statistics, SLO goodput and queueing checks of one run. Pure functions of the measured times.

Definitions (docs/bench.md repeats them for users):
- TTFT = first generated text − request sent; E2E = last byte − request sent.
- TPOT = (E2E − TTFT) / (output tokens − 1), for requests with more than one output token.
- ITL = gap between consecutive streamed chunks with text (a speculative server may put several tokens
  in one chunk, so ITL counts chunks, TPOT counts tokens).
- A request meets the SLO when it succeeded and every given bound holds (≤); a one-token request has
  TPOT 0 for this purpose, as in `vllm bench serve`.
"""
from __future__ import annotations

import math

import numpy as np

STAT_KEYS = ("mean", "median", "p90", "p95", "p99", "std")


def summarize(values) -> dict:
    """Mean, median, p90/p95/p99 (linear interpolation between order statistics) and std; None if empty."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {k: None for k in STAT_KEYS}
    p50, p90, p95, p99 = np.percentile(v, [50, 90, 95, 99])
    return {"mean": float(v.mean()), "median": float(p50), "p90": float(p90), "p95": float(p95),
            "p99": float(p99), "std": float(v.std())}


def tpot(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first; undefined for fewer than two tokens."""
    if output_tokens is None or output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


def parse_slo(text: str | None) -> dict | None:
    """`ttft:500 tpot:50 e2e:8000` (milliseconds; commas also separate) -> {"ttft_ms": 500, ...}."""
    if not text:
        return None
    slo = {}
    for part in text.replace(",", " ").split():
        name, _, value = part.partition(":")
        name = name.strip().lower()
        if name not in ("ttft", "tpot", "e2e", "e2el") or not value:
            raise ValueError(f"bad SLO {part!r}: use ttft:MS tpot:MS e2e:MS")
        ms = float(value)
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"bad SLO {part!r}: the bound must be a positive number of milliseconds")
        slo["e2e_ms" if name.startswith("e2e") else f"{name}_ms"] = ms
    return slo


def meets_slo(ok: bool, ttft_s: float | None, tpot_s: float | None, e2e_s: float | None,
              slo: dict) -> bool:
    if not ok:
        return False
    checks = (("ttft_ms", ttft_s), ("tpot_ms", 0.0 if tpot_s is None else tpot_s), ("e2e_ms", e2e_s))
    return all(value * 1000.0 <= slo[key] for key, value in checks if key in slo)


def in_flight_steps(intervals: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The in-flight count as a step function: count[i] holds on [times[i], times[i+1])."""
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    if not events:
        return np.zeros(0), np.zeros(0)
    times = np.array([t for t, _ in events])
    counts = np.cumsum([d for _, d in events])
    return times, counts


def in_flight_stats(intervals: list[tuple[float, float]], t0: float, t1: float) -> tuple[float, float]:
    """Time-average in-flight count over [t0, t1] and the least-squares slope of the count over time.

    Both are exact integrals of the step function (no sampling): the slope is
    ∫(t − t̄)(n(t) − n̄)dt / ∫(t − t̄)²dt with t̄ the window's midpoint.
    """
    if t1 <= t0:
        return float("nan"), float("nan")
    times, counts = in_flight_steps(intervals)
    if times.size == 0:
        return 0.0, 0.0
    # Segment boundaries inside the window and the count on each segment.
    edges = np.concatenate([[t0], times[(times > t0) & (times < t1)], [t1]])
    idx = np.searchsorted(times, edges[:-1], side="right") - 1   # last event at or before each edge
    level = np.where(idx >= 0, counts[np.maximum(idx, 0)], 0).astype(np.float64)
    widths = np.diff(edges)
    span = t1 - t0
    mean = float(np.sum(level * widths) / span)
    mid = (t0 + t1) / 2
    first_moment = ((edges[1:] - mid) ** 2 - (edges[:-1] - mid) ** 2) / 2   # ∫ (t − mid) dt per segment
    slope = float(np.sum((level - mean) * first_moment) / (span ** 3 / 12))
    return mean, slope


def measurement_window(sent: np.ndarray, ends: np.ndarray) -> tuple[float, float, bool]:
    """The window over which in-flight counts are averaged: while load is applied.

    That is first to last measured send, which leaves out the drain at the end (in flight decays to 0
    once arrivals stop). When sends are bunched at the start (a burst) that window is empty, so we use
    the whole span, first send to last end; the flag says which was used.
    """
    t0, t1, t_end = float(sent.min()), float(sent.max()), float(ends.max())
    if t1 - t0 < 0.1 * (t_end - t0):
        return t0, t_end, True
    return t0, t1, False


def achieved_rate(arrival_s: np.ndarray, sent_s: np.ndarray, ok_end_s: np.ndarray) -> float:
    """Completed requests per second: the λ of Little's law and of the latency model.

    Open loop: (completions − 1) / (last completion − first completion). Below saturation departures
    follow arrivals, so this is the arrival rate without the bias of counting the first request's
    latency or the drain as time; above it, departures run at the server's capacity. When every request
    arrives at 0 (closed loop, burst), completions / (last completion − first send) is exact instead.
    """
    n = len(ok_end_s)
    if n == 0:
        return 0.0
    first_send, last_end = float(sent_s.min()), float(ok_end_s.max())
    span = float(ok_end_s.max() - ok_end_s.min())
    if np.ptp(arrival_s) == 0 or n < 2 or span <= 0:
        return n / (last_end - first_send) if last_end > first_send else 0.0
    return (n - 1) / span


MIN_GAPS = 5  # fewer gaps say little about their spread


def gap_cv(arrival_s: np.ndarray) -> float | None:
    """The coefficient of variation of the gaps between sorted arrivals: what the requests met, which for a few
    dozen arrivals can be far from their process's (a seeded Poisson realisation measured 1.13-1.53, a window
    of a trace 0.68-0.97: docs/experiments/latency-validation.md, latency21). None for fewer than MIN_GAPS
    gaps or arrivals all at once (closed loops, bursts)."""
    gaps = np.diff(np.sort(np.asarray(arrival_s, dtype=float)))
    if len(gaps) < MIN_GAPS or gaps.mean() <= 0:
        return None
    return float(gaps.std() / gaps.mean())


def spec_totals(per_response: list[dict]) -> dict | None:
    """Sum per-response speculation stats; acceptance rate and mean acceptance length follow §5."""
    if not per_response:
        return None
    drafts = sum(int(s.get("num_drafts") or 0) for s in per_response)
    drafted = sum(int(s.get("num_draft_tokens") or 0) for s in per_response)
    accepted = sum(int(s.get("num_accepted_tokens") or 0) for s in per_response)
    per_pos: list[int] = []
    for s in per_response:
        for i, a in enumerate(s.get("accepted_per_position") or []):
            if i >= len(per_pos):
                per_pos.append(0)
            per_pos[i] += int(a)
    summary = spec_summary(drafts, drafted, accepted, per_pos or None, "responses")
    routed = per_draft(per_response)
    if routed:
        summary["per_draft"] = routed
    return summary


def per_draft(per_response: list[dict]) -> dict:
    """Requests and mean acceptance length of each draft, where the server routes between several."""
    out: dict[str, dict] = {}
    for s in per_response:
        if s.get("draft") is None:
            continue
        d = out.setdefault(s["draft"], {"requests": 0, "num_drafts": 0, "num_accepted_tokens": 0})
        d["requests"] += 1
        d["num_drafts"] += int(s.get("num_drafts") or 0)
        d["num_accepted_tokens"] += int(s.get("num_accepted_tokens") or 0)
    for d in out.values():
        d["mean_acceptance_length"] = 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None
    return out


def spec_summary(drafts: float, drafted: float, accepted: float, per_pos: list | None, source: str) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "accepted_per_position": per_pos,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "source": source}
