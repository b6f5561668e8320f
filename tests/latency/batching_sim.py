"""A small discrete-event continuous-batching server with speculative decoding, for testing the latency
model against a system that is *not* generated from the model's equations.

Each step, every running request runs one cycle (k draft steps and a verify of k+1 tokens, accepting a
geometric number of drafts with probability α each) and every waiting prompt is prefilled; the step takes

    T0 + T_TOK·b·(k+1) + k·(D0 + D_TOK·b)·[b > 0] + PF·Σ prompt tokens prefilled,      b = running requests

Arrivals are Poisson unless given. The first WARM requests are warm-up. The output follows the bench results schema.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

T0, T_TOK, D0, D_TOK, PF = 0.020, 0.0003, 0.001, 0.0004, 0.00002
WARM = 30
AZURE = Path(__file__).resolve().parents[2] / "specserve" / "data" / "AzureLLMInferenceTrace_conv.csv"


def azure_lengths() -> list[tuple[int, int]]:
    with open(AZURE) as f:
        return [(min(int(r["ContextTokens"]), 2048), max(2, min(int(r["GeneratedTokens"]), 512)))
                for r in csv.DictReader(f)]


def simulate(rate: float, k: int, alpha: float, lengths: list[tuple[int, int]], n: int, rng,
             arrivals: np.ndarray | None = None) -> list[dict]:
    """Per-request results: arrival, ttft, e2e, prompt and output tokens, accepted drafts. `arrivals` (n
    sorted times, s) replace the Poisson ones at `rate`."""
    if arrivals is None:
        arrivals = np.cumsum(rng.exponential(1 / rate, n))
    t, nxt, waiting, running, done = 0.0, 0, [], [], []
    while len(done) < n:
        while nxt < n and arrivals[nxt] <= t:
            p, g = lengths[rng.integers(len(lengths))]
            waiting.append({"id": nxt, "arrival": arrivals[nxt], "p": p, "g": g, "left": g, "drafts": 0, "acc": 0})
            nxt += 1
        if not waiting and not running:
            t = arrivals[nxt]
            continue
        b = len(running)
        t += (T0 + T_TOK * b * (k + 1) + (k * (D0 + D_TOK * b) if k and b else 0.0)
              + PF * sum(r["p"] for r in waiting))
        for r in running:
            accepted = 0
            while accepted < k and rng.random() < alpha:
                accepted += 1
            r["left"] -= accepted + 1
            r["drafts"] += 1 if k else 0
            r["acc"] += accepted
        for r in [r for r in running if r["left"] <= 0]:
            r["e2e"] = t - r["arrival"]
            running.remove(r)
            done.append(r)
        for r in waiting:  # the prefill step emits the first token
            r["ttft"] = t - r["arrival"]
            r["left"] -= 1
            running.append(r)
        waiting = []
    return sorted(done, key=lambda r: r["id"])


def record(label: str, k: int, rate: float, done: list[dict]) -> tuple[dict, list[dict]]:
    """A bench run record and its per-request rows (warm-up left out of the statistics)."""
    m = [r for r in done if r["id"] >= WARM]
    e2e = np.array([r["e2e"] for r in m])
    ttft = np.array([r["ttft"] for r in m])
    tpot = (e2e - ttft) / (np.array([r["g"] for r in m]) - 1)
    stats = lambda x: {"mean": float(x.mean()), "p95": float(np.quantile(x, 0.95)),  # noqa: E731
                       "p99": float(np.quantile(x, 0.99))}
    ends = np.sort([r["arrival"] + r["e2e"] for r in m])
    arr = np.array([r["arrival"] for r in m])
    grid = np.linspace(arr[0], arr[-1], 300)
    starts = np.array([r["arrival"] for r in done])
    stops = starts + np.array([r["e2e"] for r in done])
    in_flight = np.array([np.sum((starts <= x) & (stops > x)) for x in grid])
    drafts, acc = sum(r["drafts"] for r in m), sum(r["acc"] for r in m)
    run_id = f"{label}@{rate}"
    rec = {"schema": "specserve.bench.run/1", "run_id": run_id, "label": label, "k": k, "server_config": {},
           "arrival": {"process": "poisson"}, "offered_rate": rate,
           "achieved_rate": (len(ends) - 1) / (ends[-1] - ends[0]),
           "arrival_rate": (len(arr) - 1) / (arr[-1] - arr[0]), "duration_s": float(arr[-1] - arr[0]),
           "num_requests": len(m), "num_completed": len(m), "num_failed": 0,
           "mean_prompt_tokens": float(np.mean([r["p"] for r in m])),
           "mean_output_tokens": float(np.mean([r["g"] for r in m])),
           "e2e_s": stats(e2e), "ttft_s": stats(ttft), "tpot_s": stats(tpot),
           "mean_in_flight": float(in_flight.mean()), "in_flight_slope": float(np.polyfit(grid, in_flight, 1)[0]),
           "preemptions": 0, "requests_file": "sim.requests.jsonl",
           "spec": {"num_drafts": drafts, "num_accepted_tokens": acc, "mean_acceptance_length": 1 + acc / drafts}
           if k else None}
    rows = [{"run": run_id, "id": r["id"], "measured": r["id"] >= WARM, "prompt_tokens": r["p"],
             "output_tokens": r["g"], "ttft_s": r["ttft"], "e2e_s": r["e2e"], "error": None} for r in done]
    return rec, rows


def write_sim_sweep(directory: Path, configs, rates, n: int = 220, seed: int = 0) -> Path:
    """configs: [(label, k, alpha)]; every configuration at every rate, Azure conversation lengths."""
    rng = np.random.default_rng(seed)
    lengths = azure_lengths()
    runs, rows = [], []
    for label, k, alpha in configs:
        for rate in rates:
            rec, rr = record(label, k, rate, simulate(rate, k, alpha, lengths, n, rng))
            runs.append(rec)
            rows += rr
    (directory / "sim.requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = directory / "sim.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return path
