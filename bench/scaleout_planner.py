"""The capacity planner against a scale-out measurement (bench/scaleout.py's folder), re-read: no server.

Per trace load, the planner's mean E2E at 1 and 2 replicas and its replica count for the benchmark's SLO,
against what ray-1x1 and the better 2-replica router measured (medians over the repeats):

    before        the fitted model as N independent copies, Poisson arrivals (what scaleout.py's check did)
    + trace CV    the same, told the trace's own arrival-gap CV
    + co-location also the co-location term (specserve/latency/fitting/colocation.py), fitted leave one
                  load out: on the other loads' runs at 1 and 2 replicas, then asked about this load

Runs past saturation (the saturation rules of `specserve latency fit`) are not fitted on. Also: a lone
request's speed in the fit runs and in the trace runs (per-request rows), the factors fitted on every load,
which are written into DIR/model.json (its optional "colocation" part) for `specserve latency plan`, and
DIR/plan-LOAD.txt, the plan for each trace with them.

    python bench/scaleout_planner.py [--dir bench/results/scaleout] [--out DIR/planner-check.md]
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np

from specserve.benchmark.arrival_schedules import load_trace
from specserve.latency.decisions.capacity import Slo, Traffic, per_replica, plan_capacity
from specserve.latency.decisions.capacity_report import mix_classes
from specserve.latency.decisions.capacity_report import render as render_plan
from specserve.latency.fitting import model_file
from specserve.latency.fitting.colocation import Observation, fit_colocation
from specserve.latency.records.runs import BenchRun, parse_run
from specserve.latency.records.saturation import split_saturated

ONE, TWO = "ray-1x1", ("ray-2x1-pow2", "ray-2x1-latency")


def trace_traffic(path: Path) -> Traffic:
    t = load_trace(str(path))
    gaps = np.diff(t.times_s)
    return Traffic(t.mean_rate, mix_classes(t.input_tokens, t.output_tokens), float(gaps.std() / gaps.mean()),
                   f"trace {path.name}")


def read_runs(folder: Path) -> list[tuple[float, int, BenchRun]]:
    """(load, replicas, run) of the plain-decoding Ray runs at 1 and 2 replicas."""
    path, out = folder / "runs.jsonl", []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        if record["label"] in (ONE, *TWO):
            load = float(Path(record["arrival"]["trace"]["source"]).stem.removeprefix("trace-"))
            out.append((load, int(record["server_config"]["replicas"]), parse_run(record, f"{path}:{i}", folder)))
    return out


def observations(runs, traffic: dict[float, Traffic]) -> list[Observation]:
    return [Observation(n, r.arrival_rate or r.achieved_rate, r.cv, traffic[load].classes, r.e2e.mean, r.source)
            for load, n, r in runs]


def lone_speed(folder: Path) -> list[str]:
    """Mean E2E and TTFT of requests that had the server to themselves, by output length: fit vs traces."""
    def rows(path: Path):
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            return [json.loads(line) for line in f if line.strip()]

    groups = {"fit runs (fit-1x1)": rows(folder / "fit.requests.jsonl"),
              f"trace runs ({ONE})": [r for r in rows(folder / "runs.requests.jsonl.gz") if r["run"].startswith(ONE + "-")]}
    lines = ["| runs | output tokens | lone requests | mean E2E s | mean TTFT s | mean TPOT s |", "|---|---|---|---|---|---|"]
    for name, group in groups.items():
        by_run: dict[str, list[dict]] = {}
        for r in group:
            if r["measured"] and not r["error"]:
                by_run.setdefault(r["run"], []).append(r)
        alone = []
        for rs in by_run.values():
            sent, end = np.array([r["sent_s"] for r in rs]), np.array([r["end_s"] for r in rs])
            alone += [r for r in rs if np.sum((sent < r["end_s"]) & (end > r["sent_s"])) == 1]
        for g in sorted({r["output_tokens"] for r in alone}):
            mine = [r for r in alone if r["output_tokens"] == g]
            lines.append(f"| {name} | {g} | {len(mine)} | {np.mean([r['e2e_s'] for r in mine]):.3f} | "
                         f"{np.mean([r['ttft_s'] for r in mine]):.3f} | {np.mean([r['tpot_s'] for r in mine]):.4f} |")
    return lines


def check(folder: Path, slo_e2e_s: float | None = None) -> tuple[list[str], list[dict]]:
    """The comparison table (markdown lines) and its rows; fits the term on every load, saves it into
    folder/model.json and writes folder/plan-LOAD.txt, the plan with it. SLO: `slo_e2e_s`, else twice a
    lone request of the trace's mix (bench/scaleout.py's default)."""
    model_path = folder / "model.json"
    model = model_file.load(model_path).model
    traffic = {float(p.stem.removeprefix("trace-")): trace_traffic(p) for p in sorted(folder.glob("trace-*.csv"))}
    runs = read_runs(folder)
    kept, excluded = split_saturated([r for _, _, r in runs])
    kept_ids = {id(r) for r in kept}
    usable = [(load, n, r) for load, n, r in runs if id(r) in kept_ids]
    measured = {(load, n): float(np.median([r.e2e.mean for x, m, r in runs if x == load and m == n and r.label == label]))
                for load, n, label in [(x, 1, ONE) for x in traffic] + [(x, 2, c) for x in traffic for c in TWO]
                if any(x == load and m == n and r.label == label for x, m, r in runs)}
    best_two = {x: min(float(np.median([r.e2e.mean for y, m, r in runs if y == x and r.label == c])) for c in TWO)
                for x in traffic}
    rows = []
    for load, t in traffic.items():
        others = [o for o in usable if o[0] != load]
        colocation = fit_colocation(model, observations(others, traffic))
        lone = per_replica(model, Traffic(t.rate, t.classes, 1.0), 1, 0, 1.0, rate=0.0).e2e
        slo = Slo(e2e=slo_e2e_s or round(2 * lone, 2))
        variants = {"before": (Traffic(t.rate, t.classes, 1.0), None), "trace_cv": (t, None),
                    "colocation": (t, colocation)}
        row = {"load": load, "rate_rps": t.rate, "arrival_cv": t.cv, "slo_e2e_s": slo.e2e,
               "measured_e2e_s": {1: measured[(load, 1)], 2: best_two[load]},
               "measured_replicas": next((n for n in (1, 2) if (measured[(load, 1)], best_two[load])[n - 1] <= slo.e2e), ">2"),
               "factors_fitted_on": sorted({x for x, _, _ in others}),
               "factors": {s.replicas: [s.c1, s.c2] for s in colocation.slowdowns}}
        for name, (traffic_v, colo) in variants.items():
            plan = plan_capacity(model, traffic_v, slo, [0], max_replicas=8, colocation=colo)
            row[name] = {"predicted_e2e_s": {n: per_replica(model, traffic_v, n, 0, 1.0, colocation=colo).e2e for n in (1, 2)},
                         "beyond_fit": {n: plan.beyond_fit(n, 0) for n in (1, 2)},
                         "replicas": plan.dense.replicas if plan.dense else None}
        rows.append(row)
    full = fit_colocation(model, observations(usable, traffic))
    model_file.save_colocation(model_path, full)
    for row in rows:
        plan = plan_capacity(model, traffic[row["load"]], Slo(e2e=row["slo_e2e_s"]), [0], max_replicas=8, colocation=full)
        (folder / f"plan-{row['load']:g}.txt").write_text(render_plan(plan, row["arrival_cv"]) + "\n")
    return render(rows, full, excluded) + ["", "A lone request (no other in flight) in the fit runs and the trace runs:", ""] \
        + lone_speed(folder), rows


def render(rows: list[dict], full, excluded) -> list[str]:
    def cell(v: dict, n: int) -> str:
        p = v["predicted_e2e_s"][n]
        return ("saturated" if not np.isfinite(p) else f"{p:.3g}") + (" ?" if v["beyond_fit"][n] else "")

    def err(v: dict, row: dict, n: int) -> str:
        p = v["predicted_e2e_s"][n]
        return f"{p / row['measured_e2e_s'][n] - 1:+.0%}" if np.isfinite(p) else "-"

    lines = ["| load | rate req/s | trace CV | SLO s | measured 1 / 2 s | before: 1 / 2 s (error) | + trace CV | "
             "+ co-location (fitted on loads) | replicas measured / before / + CV / + co-location |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        m = row["measured_e2e_s"]
        cols = [f"{cell(row[v], 1)} / {cell(row[v], 2)} ({err(row[v], row, 1)} / {err(row[v], row, 2)})"
                for v in ("before", "trace_cv", "colocation")]
        cols[2] += f" ({', '.join(f'{x:g}' for x in row['factors_fitted_on'])})"
        planned = " / ".join(str(row[v]["replicas"] or "> 8") for v in ("before", "trace_cv", "colocation"))
        lines.append(f"| {row['load']:g} | {row['rate_rps']:.3g} | {row['arrival_cv']:.2f} | {row['slo_e2e_s']:g} | "
                     f"{m[1]:.3g} / {m[2]:.3g} | " + " | ".join(cols) + f" | {row['measured_replicas']} / {planned} |")
    lines.append("(measured: ray-1x1 and the better 2-replica router, medians of the repeats; ? : past the fitted "
                 "runs' highest rate, not chosen by the planner.)")
    lines += ["", "Co-location factors fitted on every load (written into model.json): "
              + "; ".join(f"{s.replicas} replica(s): s1 {s.c1:.3f}, s2 {s.c2:.3f} ({s.n_runs} runs, "
                          f"MAPE {s.mape:.1f} %)" for s in full.slowdowns)]
    if excluded:
        lines.append("Not fitted on (past saturation): " + "; ".join(
            f"{e.run.label} at {e.run.arrival_rate:.3g} req/s ({e.reasons[0]})" for e in excluded))
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="bench/results/scaleout", help="a bench/scaleout.py output folder")
    p.add_argument("--out", help="where to write the report (default DIR/planner-check.md)")
    args = p.parse_args()
    folder = Path(args.dir)
    lines, _ = check(folder)
    command = " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    text = "\n".join([f"Command: python {command}", "", *lines]) + "\n"
    Path(args.out or folder / "planner-check.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
