"""Does a latency model fitted under one arrival process predict the same server under another?

Fits `specserve latency fit`'s model on --fit results (e.g. a Poisson sweep) and predicts every run of
--test results (e.g. the same configurations replaying the Azure conversation trace, `specserve bench sweep
--scale-trace`) at its achieved rate, k, measured acceptance length and stated arrival CV: what a user
knows before running it. Prints observed against predicted mean E2E per run, and MAPE and bias per
configuration and overall (saturated test runs, which a steady-state model cannot speak for, are listed
and left out, as `fit` leaves them out). `--realised-cv`: each run's arrival CV is the one its measured requests
met (their gaps' CV, from the per-request rows) instead of its process's nominal one (Poisson 1; a trace is
taken as Poisson): a seeded Poisson realisation of a few dozen arrivals, or a trace window, can be far from it.
(Records written since 2026-11-29 carry it as `arrival_gap_cv`, which `fit` uses anyway; this reads it from the
per-request rows of older ones.) `--drift TRACE`: the mean E2E is averaged over the rate drift fitted from that
trace (specserve/latency/equations/rate_drift.py) within each run's measured requests, its fast gaps' CV
the trace's (or, with --realised-cv, the run's).

    python bench/latency_transfer.py --fit bench/results/latency21/r{1,2,3}/fixed.jsonl \
        --test bench/results/latency21/trace/fixed.jsonl --markdown bench/results/latency21/transfer.md
"""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np

from specserve.benchmark.metrics import gap_cv
from specserve.benchmark.arrival_schedules import load_trace
from specserve.latency.equations.arrival_regularity import run_cv
from specserve.latency.equations.rate_drift import RateDrift, fit_rate_drift, over_drift
from specserve.latency.fitting.crossval import observed_predicted, summarize
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.requests import rows_by_run
from specserve.latency.records.runs import load_runs
from specserve.latency.records.saturation import split_saturated


def realised_cv(runs):
    """The runs with arrival_cv set to the CV of their measured requests' arrival gaps (as `specserve bench`
    records it since, `arrival_gap_cv`), read from their per-request rows."""
    rows = {key: group for path in {r.requests_path for r in runs if r.requests_path}
            for key, group in rows_by_run(Path(path)).items()}

    def measured_cv(run):
        arrivals = [row["arrival_s"] for row in rows.get(run.run_key, []) if row.get("measured")]
        return run_cv(None, None, gap_cv(np.array(arrivals)))
    return [replace(r, arrival_cv=measured_cv(r) or r.arrival_cv) for r in runs]


def transfer(fit_paths: list[str], test_paths: list[str], realised: bool = False,
             drift: RateDrift | None = None) -> list[str]:
    """Markdown lines: the per-run table, then MAPE and bias of mean E2E per configuration and overall."""
    arrivals = realised_cv if realised else list
    model = fit_runs(arrivals(load_runs(fit_paths)), FitOptions(cross_validate=False)).model
    kept, excluded = split_saturated(arrivals(load_runs(test_paths)))
    if drift is not None and not realised:
        kept = [replace(r, arrival_cv=drift.cv) for r in kept]
    lines = [f"Fitted on {', '.join(fit_paths)}; tested on {', '.join(test_paths)}.", "",
             *([] if drift is None else [f"Rate drift: fast gaps' CV {drift.cv:.2f}, rate variance v² {drift.variance:.4f}, "
                                         f"correlation {drift.correlation:.0f} mean gaps.", ""]),
             "| run | k | E | achieved rate (req/s) | arrival CV used | mean E2E measured (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|---|---|"]
    pairs: dict[str, list[dict]] = {}
    for run in sorted(kept, key=lambda r: (r.k, r.achieved_rate)):
        pair = observed_predicted(model, run)
        if drift is not None:
            def latency_at(rate, run=run):
                return model.latency(rate, run.k, run.acceptance_length, run.output_tokens, run.prompt_tokens,
                                     run.cv, run.lifetimes)
            pair["e2e"] = (pair["e2e"][0], over_drift(latency_at, run.achieved_rate, drift, run.num_requests))
        observed, predicted = pair["e2e"]
        pairs.setdefault(run.label, []).append({"e2e": pair["e2e"]})
        lines.append(f"| {run.label} | {run.k} | {run.acceptance_length:.2f} | {run.achieved_rate:.3f} | {run.cv:.2f} | "
                     f"{observed:.3f} | {predicted:.3f} | {(predicted - observed) / observed:+.1%} |")
    lines += ["", "| configuration | runs | mean E2E MAPE | bias |", "|---|---|---|---|"]
    for label, label_pairs in [*pairs.items(), ("all", [p for ps in pairs.values() for p in ps])]:
        e2e = summarize(label_pairs)["e2e"]
        lines.append(f"| {label} | {e2e['n']} | {e2e['mape']:.2f}% | {e2e['bias']:+.2f}% |")
    for x in excluded:
        lines.append(f"\nLeft out, saturated: {x.run.label} at {x.run.achieved_rate:.3f} req/s ({', '.join(x.reasons)}).")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", nargs="+", required=True, help="results JSONL files the model is fitted on")
    p.add_argument("--test", nargs="+", required=True, help="results JSONL files whose runs it predicts")
    p.add_argument("--realised-cv", action="store_true", help="arrival CVs as the measured requests met them")
    p.add_argument("--drift", metavar="TRACE", help="average over the rate drift of this trace (e.g. azure-conv)")
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = p.parse_args()
    drift = fit_rate_drift(load_trace(args.drift).times_s) if args.drift else None
    text = "\n".join(transfer(args.fit, args.test, args.realised_cv, drift)) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(f"Written by `python bench/latency_transfer.py --fit {' '.join(args.fit)} "
                                 f"--test {' '.join(args.test)}{' --realised-cv' if args.realised_cv else ''}"
                                 f"{f' --drift {args.drift}' if args.drift else ''} --markdown {args.markdown}`\n\n" + text)


if __name__ == "__main__":
    main()
