"""Synthetic `specserve bench` results drawn from known coefficients, for recovery and CLI tests.

Every latency is generated from the model's own equations with multiplicative Gaussian noise, so a correct
fitter must recover the coefficients below; saturated runs are added with the symptoms the schema names
(achieved < offered with a growing queue, preemptions, failures) and inflated latencies that would bias any
fit that kept them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specserve.latency.equations.acceptance import expected_tokens
from specserve.latency.equations.arrival_regularity import EQUAL, Lifetimes, busy_on_arrival, company, loaded_latency
from specserve.latency.equations.formulas import SpecCoefficients
from specserve.latency.equations.moe import MoeDemands, MoeExperts, moe_latency
from specserve.latency.equations.slots import slot_delay, slot_saturation

TRUE = SpecCoefficients(c1p=0.3, c1v=0.02, c1d=0.004, c2p=0.05, c2v=0.002, c2d=0.002)
TTFT = {"t1": 0.04, "tw": 0.5, "tc": 1.0}  # phases.py: lone, busy-batch cycles, catch-up collisions
TPOT = {"s1v": 0.02, "s1d": 0.004, "s2v": 0.002, "s2d": 0.002}
CATCH_UP = 0.06  # D: a request's first speculative step runs this much longer (seen only in the rows)
TAILS = {"p95": (1.15, 2.6), "p99": (1.3, 4.0)}  # (a, b): base and load multipliers
PREFILL_PER_TOKEN = 2e-4
CONFIGS = (("no-sd", 0, None), ("k1", 1, 0.75), ("k2", 2, 0.75), ("k4", 4, 0.7), ("k6", 6, 0.7))


@dataclass
class Sweep:
    """What to generate."""

    configs: tuple = CONFIGS
    load_fractions: tuple = tuple(np.linspace(0.1, 0.8, 8))  # of the lowest saturation rate
    noise: float = 0.005
    prompt_tokens: int = 256
    output_tokens: int = 128
    extra_output_tokens: tuple = ()  # further output lengths to sweep every configuration at ("<label>-g<N>")
    output_spread: int = 0  # > 0: per-request output lengths vary by ± this (mixed-length traffic; with
    # per-request rows, the latencies follow the company of those lengths' lifetimes)
    saturated: bool = True
    rows: bool = True
    moe: MoeExperts | None = None
    moe_split: dict = field(default_factory=lambda: {"share": 0.6})  # fraction of each demand that is φ-scaled
    arrival_cv: float = 1.0  # CV of the arrival gaps (1 = Poisson; else Gamma, recorded as bench does)
    slots: int | None = None  # the server runs at most this many requests at once, the rest wait (slots.py)
    seed: int = 0


def _slot_wait(sweep: Sweep, rate: float, k: int, e: float, g: float, lifetimes: Lifetimes = EQUAL) -> tuple:
    """(latency the slot cap adds, mean wait for a slot)."""
    d = TRUE.demands(g, e, k)
    uncapped = float(loaded_latency(d.c1, d.c2, rate, sweep.arrival_cv, lifetimes))
    return slot_delay(uncapped, d.c1, d.c2, rate, sweep.slots, sweep.arrival_cv, lifetimes.cv)


def _latency(sweep: Sweep, rate: float, k: int, e: float, g: float, lifetimes: Lifetimes = EQUAL) -> float:
    d = TRUE.demands(g, e, k)
    if sweep.moe is None:
        return (float(loaded_latency(d.c1, d.c2, rate, sweep.arrival_cv, lifetimes))
                + _slot_wait(sweep, rate, k, e, g, lifetimes)[0])
    s = sweep.moe_split["share"]
    return moe_latency(rate, MoeDemands(d.c1 * (1 - s), d.c1 * s, d.c2 * (1 - s), d.c2 * s), sweep.moe, k + 1,
                       sweep.arrival_cv, lifetimes)


def _stats(mean: float, base: float, load: float, rng, noise: float) -> dict:
    jitter = lambda: 1 + noise * rng.standard_normal()  # noqa: E731
    out = {"mean": mean, "median": mean * 0.95, "std": mean * 0.3}
    for q, (a, b) in TAILS.items():
        out[q] = (a * base + b * load) * jitter()
    out["p90"] = out["p95"] * 0.95
    return out


def _record(sweep, rng, label, k, alpha, e, rate, scale=1.0, e2e=None, g=None, lifetimes=EQUAL,
            **extra) -> tuple[dict, float]:
    g, p, n = g or sweep.output_tokens, sweep.prompt_tokens, 200
    noise = lambda: 1 + sweep.noise * rng.standard_normal()  # noqa: E731
    lone = _latency(sweep, 0.0, k, e, g)
    e2e = e2e or _latency(sweep, rate, k, e, g, lifetimes) * scale
    wait = _slot_wait(sweep, rate, k, e, g, lifetimes)[1]
    b, cv = rate * (e2e - wait), sweep.arrival_cv  # those waiting for a slot are not in the batch
    catch_up = CATCH_UP if k and sweep.rows else 0.0  # without rows the fitter cannot measure it
    cycle = TPOT["s1v"] + k * TPOT["s1d"] + company(b, cv) * (TPOT["s2v"] + k * TPOT["s2d"])
    ttft_base = TTFT["t1"]
    ttft_load = TTFT["tw"] * busy_on_arrival(b, cv) * cycle + TTFT["tc"] * rate * catch_up ** 2 / 2 + wait
    tpot_base = (TPOT["s1v"] + k * TPOT["s1d"]) / e + catch_up / (g - 1)
    tpot_load = company(b, cv) * (TPOT["s2v"] + k * TPOT["s2d"]) / e + catch_up * b / (g - 1)
    # The tails scale the load every request in flight would add (λ·L company), as tails.py models them.
    tail_load = e2e - lone + (TRUE.demands(g, e, k).c2 * (rate * e2e - company(rate * e2e, cv, lifetimes))
                              if sweep.moe is None else 0.0)
    process = {"process": "poisson"} if cv == 1.0 else {"process": "gamma", "burstiness": cv}
    offered = rate  # below saturation the achieved rate is the arrival rate (schema v1)
    record = {
        "schema": "specserve.bench.run/1", "label": label, "server_config": {"k": k}, "k": k,
        "base_url": "http://synthetic", "model": "synthetic", "endpoint": "/v1/completions",
        "arrival": {**process, "request_rate": offered}, "offered_rate": offered,
        "achieved_rate": rate, "arrival_rate": rate * (1 + 0.01 * rng.standard_normal()), "duration_s": n / rate, "num_requests": n, "num_completed": n,
        "num_failed": 0, "mean_prompt_tokens": float(p), "mean_output_tokens": float(g),
        "e2e_s": _stats(e2e * noise(), lone, tail_load, rng, sweep.noise),
        "ttft_s": _stats((ttft_base + ttft_load) * noise(), ttft_base, ttft_load, rng, sweep.noise),
        "tpot_s": _stats((tpot_base + tpot_load) * noise(), tpot_base, tpot_load, rng, sweep.noise),
        "itl_s": {"mean": tpot_base}, "mean_in_flight": rate * e2e, "littles_law_in_flight": rate * e2e,
        # a stable queue: the fitted trend over the run moves the count by a fraction of a request
        "in_flight_slope": 0.2 * rng.standard_normal() * rate / n, "preemptions": 0,
        "spec": None if k == 0 else {
            "num_drafts": 1000, "num_draft_tokens": 1000 * k, "num_accepted_tokens": round(1000 * (e - 1)),
            "acceptance_rate": (e - 1) / k, "mean_acceptance_length": e,
            "accepted_per_position": [round(1000 * alpha ** j) for j in range(1, k + 1)]},
        "output_throughput_tps": rate * g, "started_at": "2026-01-01T00:00:00Z",
    }
    record.update(extra)
    return record, ttft_base + ttft_load


def _output_lengths(sweep, rng, g_mean) -> list[int]:
    if not sweep.output_spread:
        return [g_mean] * 40
    return [g_mean + int(rng.integers(-sweep.output_spread, sweep.output_spread + 1)) for _ in range(40)]


def _rows(sweep, rng, run_id, ttft_mean, lengths, k: int) -> list[dict]:
    rows = []
    gap = TPOT["s1v"] + k * TPOT["s1d"]
    gaps = [gap + (CATCH_UP if k else 0.0)] + [gap] * 20  # streamed chunks: the first waits for the catch-up
    for i, g in enumerate(lengths):
        p = sweep.prompt_tokens + int(rng.integers(-64, 65))
        ttft = (ttft_mean + PREFILL_PER_TOKEN * (p - sweep.prompt_tokens)) * (1 + sweep.noise * rng.standard_normal())
        rows.append({"run": run_id, "id": i, "measured": True, "prompt_tokens": p, "output_tokens": g,
                     "ttft_s": ttft, "e2e_s": None, "spec": None, "error": None,
                     "itl_s": gaps})
    return rows


def write_sweep(directory: Path, sweep: Sweep | None = None, name: str = "results.jsonl") -> Path:
    """Write results JSONL (+ per-request side files) and return its path."""
    sweep = sweep or Sweep()
    rng = np.random.default_rng(sweep.seed)
    directory.mkdir(parents=True, exist_ok=True)
    expected = {label: expected_tokens(a, k) if k else 1.0 for label, k, a in sweep.configs}
    # Shared rates per output length, up to a fraction of that length's lowest saturation rate (as a real
    # sweep does: every k at the same 8 rates).
    def saturation(g: float, label: str, k: int) -> float:
        d = TRUE.demands(g, expected[label], k)
        return 1 / d.c2 if sweep.slots is None else min(1 / d.c2, slot_saturation(d.c1, d.c2, sweep.slots))

    tops = {g: min(saturation(g, lab, k) for lab, k, _ in sweep.configs)
            for g in (sweep.output_tokens,) + tuple(sweep.extra_output_tokens)}
    top = tops[sweep.output_tokens]
    lines = []
    lengths = (sweep.output_tokens,) + tuple(sweep.extra_output_tokens)
    for (label, k, alpha), g in ((c, g) for g in lengths for c in sweep.configs):
        e = expected[label]
        if g != sweep.output_tokens:
            label = f"{label}-g{g}"
        for i, frac in enumerate(sweep.load_fractions):
            run_id = f"{label}-{i}"
            lengths = _output_lengths(sweep, rng, g) if sweep.rows else [g]
            record, ttft_mean = _record(sweep, rng, label, k, alpha, e, frac * tops[g], run_id=run_id, g=g,
                                        lifetimes=Lifetimes.of(lengths))
            if sweep.rows:
                side = f"requests-{run_id}.jsonl"
                record["requests_file"] = side
                (directory / side).write_text("".join(json.dumps(r) + "\n" for r in
                                                      _rows(sweep, rng, run_id, ttft_mean, lengths, k)))
            lines.append(record)
    if sweep.saturated:
        label, k, alpha = sweep.configs[-1]
        e = expected[label]
        sat = 1 / TRUE.demands(sweep.output_tokens, e, k).c2
        # Overloaded: achieved below offered, queue growing, latency set by the run length, not the rate.
        lone = _latency(sweep, 0.0, k, e, sweep.output_tokens)
        rec, _ = _record(sweep, rng, label, k, alpha, e, 0.97 * sat, e2e=8 * lone, in_flight_slope=0.3 * sat)
        rec["offered_rate"] = rec["arrival_rate"] = 1.3 * sat
        lines.append(rec)
        # Preempting and failing runs below saturation, with latencies the clean model cannot produce.
        lines.append(_record(sweep, rng, label, k, alpha, e, 0.5 * top, scale=1.6, preemptions=7)[0])
        lines.append(_record(sweep, rng, sweep.configs[0][0], 0, None, 1.0, 0.45 * top, scale=1.5,
                             num_failed=12)[0])
    path = directory / name
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def minimal_record(**overrides) -> dict:
    """One valid run line with round numbers, for parser and rule tests."""
    stats = {"mean": 2.0, "median": 1.9, "p95": 3.0, "p99": 4.0}
    record = {"schema": "specserve.bench.run/1", "run_id": "r1", "label": "k2", "k": 2, "server_config": {},
              "offered_rate": 1.0, "achieved_rate": 1.0, "duration_s": 100.0, "num_requests": 100,
              "num_completed": 100, "num_failed": 0, "mean_prompt_tokens": 256, "mean_output_tokens": 128,
              "e2e_s": stats, "ttft_s": {"mean": 0.1}, "tpot_s": {"mean": 0.02}, "mean_in_flight": 2.0,
              "in_flight_slope": 0.0, "preemptions": 0,
              "spec": {"num_drafts": 100, "num_accepted_tokens": 150, "mean_acceptance_length": 2.5}}
    record.update(overrides)
    return record


def write_records(path: Path, *records: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
