"""Does a latency model fitted under one arrival process predict the same server under another?

Fits `specserve latency fit`'s model on --fit results (e.g. a Poisson sweep) and predicts every run of
--test results (e.g. the same configurations replaying the Azure conversation trace, `specserve bench sweep
--scale-trace`) at its achieved rate, k, measured acceptance length and stated arrival CV: what a user
knows before running it. Prints observed against predicted mean E2E per run, and MAPE and bias per
configuration and overall (saturated test runs, which a steady-state model cannot speak for, are listed
and left out, as `fit` leaves them out).

    python bench/latency_transfer.py --fit bench/results/latency21/r{1,2,3}/fixed.jsonl \
        --test bench/results/latency21/trace/fixed.jsonl --markdown bench/results/latency21/transfer.md
"""
from __future__ import annotations

import argparse
from pathlib import Path

from specserve.latency.crossval import observed_predicted, summarize
from specserve.latency.fit import FitOptions, fit_runs
from specserve.latency.runs import load_runs
from specserve.latency.saturation import split_saturated


def transfer(fit_paths: list[str], test_paths: list[str]) -> list[str]:
    """Markdown lines: the per-run table, then MAPE and bias of mean E2E per configuration and overall."""
    model = fit_runs(load_runs(fit_paths), FitOptions(cross_validate=False)).model
    kept, excluded = split_saturated(load_runs(test_paths))
    lines = [f"Fitted on {', '.join(fit_paths)}; tested on {', '.join(test_paths)}.", "",
             "| run | k | E | achieved rate (req/s) | arrival CV used | mean E2E measured (s) | predicted (s) | error |",
             "|---|---|---|---|---|---|---|---|"]
    pairs: dict[str, list[dict]] = {}
    for run in sorted(kept, key=lambda r: (r.k, r.achieved_rate)):
        pair = observed_predicted(model, run)
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
    p.add_argument("--markdown", type=Path, help="also write the tables to this file")
    args = p.parse_args()
    text = "\n".join(transfer(args.fit, args.test)) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(f"Written by `python bench/latency_transfer.py --fit {' '.join(args.fit)} "
                                 f"--test {' '.join(args.test)} --markdown {args.markdown}`\n\n" + text)


if __name__ == "__main__":
    main()
