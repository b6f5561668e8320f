"""Which runs of a sweep ran slow, and when: the machine's speed drift read from the runs themselves.

Each run's mean E2E is compared with its configuration's line E2E = C1 + C2 * company, least squares
over that configuration's runs, where company is what the latency model charges a request for (the
others in flight over its lifetime, `specserve.latency.equations.arrival_regularity.company`) at the run's *measured* load
(its mean in-flight count, λ·L by Little's law) and arrival CV. The measured load already carries the
run's queueing, so what a run leaves off its line is the machine's speed at the time (plus the line's
misfit). Runs are listed in start order; the summary averages the residuals by sixths of the sweep's
duration and by rate fraction. In an interleaved sweep (`bench sweep --interleave`) every sixth holds
every configuration, so a time trend there is drift, not a configuration's offset.

Two measures of the machine's speed, each a slowness per run (1.0: the sweep's median speed; 1.1: 10 %
slower):
- `--probes` reads the speed probes of `bench sweep --interleave --probe N` (RESULTS.probes.jsonl: lone
  requests to the first configuration before and after every run): the mean E2E of the probes either
  side of a run over the median probe's.
- `--step-times` reads the runs' own decode steps from their per-request rows (RESULTS.requests.jsonl).
  Each streamed chunk is one engine step; the other requests' first and last tokens tell how many were
  decoding beside it. A configuration's step at a given batch size takes the same time in every run on a
  steady machine, so a run's slowness is the median over its chunks of chunk time / its configuration's
  median chunk time at that batch size over the sweep (chunks during which another request was being
  prefilled left out). It compares like with like and so does not see load.
For each, the script prints how well it tracks the residuals above, then the held-out validation tables
(`specserve latency validate`) on the runs as measured and with every run rescaled to the sweep's median
speed (latencies divided by its slowness, rates multiplied by it: the same run on a machine running at
that speed). The rescaled tables say how far the model misses once the machine's measured drift is taken
out; the issue's goals are scored on the runs as measured.

    python bench/run_drift.py runs/latency16/fixed.jsonl [--quiet]
    python bench/run_drift.py bench/results/latency19/fixed.jsonl \
        --probes bench/results/latency19/fixed.probes.jsonl --step-times
    python bench/run_drift.py bench/results/latency20/fixed.jsonl --step-times --quiet \
        --markdown bench/results/latency20/drift.md     # the committed tables
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from datetime import datetime

import numpy as np

from specserve.benchmark.results import read_request_rows, read_runs
from specserve.latency.equations.arrival_regularity import company, run_cv
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import BenchRun, Stats, load_runs
from specserve.latency.fitting.validate import markdown

PARTS = 6
MIN_CHUNKS = 50  # chunks at one (configuration, batch size) needed for a reference step time


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


def completed_probes(probes: list[dict]) -> list[dict]:
    """The probes that completed a request, in start order."""
    done = sorted((p for p in probes if p.get("num_completed")), key=lambda p: p["started_at"])
    if not done:
        raise SystemExit("no probe completed a request")
    return done


def probe_slowness(runs: list[dict], probes: list[dict]) -> dict[str, float]:
    """{run_id: how slow the machine was around the run}: the mean E2E of the probes just before and just
    after it over the median probe's (1.0: the sweep's median speed; 1.1: 10 % slower)."""
    probes = completed_probes(probes)
    median = statistics.median(p["e2e_s"]["mean"] for p in probes)
    out = {}
    for r in runs:
        near = ([p for p in probes if p["started_at"] <= r["started_at"]][-1:]
                + [p for p in probes if p["started_at"] > r["started_at"]][:1])
        out[r["run_id"]] = statistics.fmean(p["e2e_s"]["mean"] for p in near) / median
    return out


def at_median_speed(run: BenchRun, slow: float) -> BenchRun:
    """The run in the time of a machine at the sweep's median speed: every latency divided by `slow`,
    every rate multiplied by it (requests in flight, counts and lengths unchanged)."""
    def stats(s: Stats) -> Stats:
        return Stats(*(None if v is None else v / slow for v in (s.mean, s.p95, s.p99, s.std)))

    def rate(v: float | None) -> float | None:
        return None if v is None else v * slow

    return replace(run, e2e=stats(run.e2e), ttft=stats(run.ttft), tpot=stats(run.tpot),
                   achieved_rate=run.achieved_rate * slow, offered_rate=rate(run.offered_rate),
                   arrival_rate=rate(run.arrival_rate), duration_s=run.duration_s / slow,
                   in_flight_slope=rate(run.in_flight_slope))


def step_chunks(rows: list[dict]) -> list[tuple[int, float]]:
    """(batch size, seconds) of every chunk the run's measured requests streamed, leaving out chunks during
    which another request was being prefilled. The batch size counts the requests (warm-up ones too)
    decoding for the whole chunk, the chunk's own included."""
    rows = [r for r in rows if not r.get("error") and r.get("itl_s")
            and all(isinstance(r.get(k), (int, float)) for k in ("sent_s", "first_token_s", "end_s"))]
    if not rows:
        return []
    sent, first, end = (np.array([r[k] for r in rows], dtype=float) for k in ("sent_s", "first_token_s", "end_s"))
    out = []
    for i, r in enumerate(rows):
        if not r.get("measured", True):
            continue
        others = np.arange(len(rows)) != i
        itl = np.asarray(r["itl_s"], dtype=float)
        stop = r["first_token_s"] + np.cumsum(itl)
        begin = stop - itl
        decoding = (first[others] <= begin[:, None]) & (end[others] >= stop[:, None])
        prefilling = ((sent[others] < stop[:, None]) & (first[others] > begin[:, None])).any(axis=1)
        out += [(1 + int(b), float(t)) for b, t, p in zip(decoding.sum(axis=1), itl, prefilling) if not p]
    return out


def step_slowness(runs: list[dict], rows: dict[str, list[dict]], min_chunks: int = MIN_CHUNKS) -> dict[str, float]:
    """{run_id: how slow the machine was during the run}, from its own decode steps (`step_chunks`):
    the median over its chunks of chunk time / the configuration's median at that batch size over all
    runs, using batch sizes with at least `min_chunks` chunks. Runs without such chunks are left out."""
    chunks = {r["run_id"]: step_chunks(rows.get(r["run_id"], [])) for r in runs}
    pooled: dict[tuple[str, int], list[float]] = {}
    for r in runs:
        for b, t in chunks[r["run_id"]]:
            pooled.setdefault((r["label"], b), []).append(t)
    reference = {key: statistics.median(v) for key, v in pooled.items() if len(v) >= min_chunks}
    out = {}
    for r in runs:
        ratios = [t / reference[(r["label"], b)] for b, t in chunks[r["run_id"]] if (r["label"], b) in reference]
        if ratios:
            out[r["run_id"]] = statistics.median(ratios)
    return out


def probe_spread(probes: list[dict]) -> None:
    """Print the probes' median, their spread over the sweep and from one probe to the next."""
    e2e = [p["e2e_s"]["mean"] for p in completed_probes(probes)]
    median = statistics.median(e2e)
    # Successive differences over sqrt(2): a probe's own noise, which a slow drift hardly moves.
    own = statistics.pstdev(b - a for a, b in zip(e2e, e2e[1:])) / 2 ** 0.5 if len(e2e) > 2 else float("nan")
    print(f"\n{len(e2e)} probes: median E2E {median:.3g} s, spread over the sweep "
          f"{100 * statistics.pstdev(e2e) / median:.1f} %, probe to probe {100 * own / median:.1f} %")


def track(name: str, slow: dict[str, float], rows: list[tuple[dict, float]]) -> dict:
    """Print how a slowness measure tracks the residuals; return the correlation and the residual spread
    as measured and with each run's E2E divided by its slowness (%)."""
    rows = [(r, res) for r, res in rows if r["run_id"] in slow]
    x = np.array([100.0 * (slow[r["run_id"]] - 1.0) for r, _ in rows])
    y = np.array([res for _, res in rows])
    slope, intercept = np.polyfit(x, y, 1)
    out = {"correlation": float(np.corrcoef(x, y)[0, 1])}
    print(f"{name}: slowness by sixth of the sweep's time "
          + ", ".join(f"{m:+.1f} %" for _, m in by_time([(r, v) for (r, _), v in zip(rows, x)]))
          + f"; against the residuals of {len(rows)} runs: correlation {out['correlation']:.2f}, "
          f"residual = {slope:.2f} x slowness {intercept:+.1f} %")
    adjusted = residuals([dict(r, e2e_s=dict(r["e2e_s"], mean=r["e2e_s"]["mean"] / slow[r["run_id"]]))
                          for r, _ in rows])
    out["spread"], out["spread_divided"] = statistics.pstdev(y), statistics.pstdev(res for _, res in adjusted)
    print(f"residual spread (SD) {out['spread']:.1f} % as measured, "
          f"{out['spread_divided']:.1f} % with each run's E2E divided by its {name} slowness")
    return out


def validations(results: str, slowness: dict[str, dict[str, float]], markdown_file: str | None = None) -> dict[str, float]:
    """Print the held-out tables as measured and rescaled by each slowness measure (and write them to
    markdown_file); return the held-out-rate MAPE of each ("measured" and the measures' names)."""
    runs = load_runs([results])
    out = {}
    sections = []
    for name, fitted in [("measured", runs)] + [
            (n, [at_median_speed(r, slow[r.run_key]) for r in runs if r.run_key in slow]) for n, slow in slowness.items()]:
        report = fit_runs(fitted, FitOptions(), [results])
        out[name] = report.cross_validation["rate"]["overall"]["e2e"]["mape"]
        title = "as measured" if name == "measured" else f"at the sweep's median speed ({name})"
        section = f"### Held-out validation, runs {title}\n\n{markdown(report)}"
        print("\n" + section)
        sections.append(section)
    if markdown_file:
        with open(markdown_file, "w") as f:
            f.write(f"Tables written by `python bench/run_drift.py {' '.join(sys.argv[1:])}`\n\n" + "\n".join(sections))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--probes", help="the sweep's RESULTS.probes.jsonl (bench sweep --probe)")
    p.add_argument("--step-times", action="store_true", help="the runs' own step times (per-request rows)")
    p.add_argument("--markdown", help="also write the held-out tables (as measured and rescaled) to this file")
    args = p.parse_args()
    records = read_runs(args.results)
    rows = residuals(records)
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
    slowness = {}
    if args.probes:
        probes = read_runs(args.probes)
        probe_spread(probes)
        slowness["probes"] = probe_slowness([r for r, _ in rows], probes)
    if args.step_times:
        slowness["step times"] = step_slowness(records, read_request_rows(args.results))
    for name, slow in slowness.items():
        track(name, slow, rows)
    if slowness:
        validations(args.results, slowness, args.markdown)


if __name__ == "__main__":
    main()
