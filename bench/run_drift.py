"""Which runs of a sweep ran slow, and when: the machine's speed drift read from the runs themselves.

Each run's mean E2E is compared with its configuration's line E2E = C1 + C2 * company, least squares
over that configuration's runs, where company is what the latency model charges a request for (the
others in flight over its lifetime, `specserve.latency.arrivals.company`) at the run's *measured* load
(its mean in-flight count, λ·L by Little's law) and arrival CV. The measured load already carries the
run's queueing, so what a run leaves off its line is the machine's speed at the time (plus the line's
misfit). Runs are listed in start order; the summary averages the residuals by sixths of the sweep's
duration and by rate fraction. In an interleaved sweep (`bench sweep --interleave`) every sixth holds
every configuration, so a time trend there is drift, not a configuration's offset.

    python bench/run_drift.py runs/latency16/fixed.jsonl [--quiet]
"""
from __future__ import annotations

import argparse
import statistics
from datetime import datetime

import numpy as np

from specserve.benchmark.results import read_runs
from specserve.latency.arrivals import company, run_cv

PARTS = 6


def residuals(runs: list[dict]) -> list[tuple[dict, float]]:
    """(run, % off its configuration's line), in start order; runs that completed nothing are skipped."""
    runs = sorted((r for r in runs if r.get("num_completed") and r.get("mean_in_flight") is not None),
                  key=lambda r: r["started_at"])
    off = {}
    for label in {r["label"] for r in runs}:
        own = [r for r in runs if r["label"] == label]
        b = np.array([company(r["mean_in_flight"], _cv(r)) for r in own])
        e2e = np.array([r["e2e_s"]["mean"] for r in own])
        coef = np.linalg.lstsq(np.c_[np.ones_like(b), b], e2e, rcond=None)[0] if len(own) > 1 else [e2e[0], 0.0]
        for r, bi, li in zip(own, b, e2e):
            line = coef[0] + coef[1] * bi
            off[r["run_id"]] = 100.0 * (li - line) / line
    return [(r, off[r["run_id"]]) for r in runs]


def _cv(run: dict) -> float:
    arrival = run.get("arrival") or {}
    cv = run_cv(arrival.get("process"), arrival.get("burstiness"))
    return 1.0 if cv is None else cv


def by_time(rows: list[tuple[dict, float]], parts: int = PARTS) -> list[tuple[int, float]]:
    """(runs, mean residual %) in each of `parts` equal spans of the sweep's start times."""
    t = [datetime.fromisoformat(r["started_at"]).timestamp() for r, _ in rows]
    span = (max(t) - min(t)) or 1.0
    groups = [[] for _ in range(parts)]
    for ti, (_, res) in zip(t, rows):
        groups[min(int((ti - min(t)) / span * parts), parts - 1)].append(res)
    return [(len(g), statistics.fmean(g) if g else float("nan")) for g in groups]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    args = p.parse_args()
    rows = residuals(read_runs(args.results))
    if not args.quiet:
        print("| start | config | rate fraction | mean in flight | mean E2E (s) | off its line |\n"
              "|---|---|---|---|---|---|")
        for r, res in rows:
            print(f"| {r['started_at'][11:19]} | {r['label']} | {r.get('sweep', {}).get('fraction', '-')} | "
                  f"{r['mean_in_flight']:.2f} | {r['e2e_s']['mean']:.2f} | {res:+.1f} % |")
    print(f"\nmean residual by sixth of the sweep's time: "
          + ", ".join(f"{m:+.1f} % ({n})" for n, m in by_time(rows)))
    fractions = sorted({r["sweep"]["fraction"] for r, _ in rows if "fraction" in r.get("sweep", {})})
    if fractions:
        print("mean residual by rate fraction: " + ", ".join(
            f"{f:g}: {statistics.fmean(res for r, res in rows if r.get('sweep', {}).get('fraction') == f):+.1f} %"
            for f in fractions))
    print(f"residual spread (SD) {statistics.pstdev(res for _, res in rows):.1f} % over {len(rows)} runs")


if __name__ == "__main__":
    main()
