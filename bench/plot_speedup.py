"""Speedup of speculative decoding over plain decoding vs request rate, from a committed sweep.

Points: measured. Each speculative run's mean E2E is compared with plain decoding's at the same achieved
rate (plain decoding's runs interpolated linearly in the rate; runs outside plain decoding's measured
range have no point). Lines: the latency model fitted on the same runs (`specserve latency fit`),
L_plain(λ) / L_k(λ) at each configuration's measured acceptance length, drawn up to the rate where that
configuration saturates or plain decoding's highest measured rate. Prints the points as a table.

    python bench/plot_speedup.py                       # bench/results/latency20 -> docs/speedup_vs_load.png
    python bench/plot_speedup.py bench/results/latency19/fixed.jsonl -o /tmp/speedup.png
    python bench/plot_speedup.py bench/results/latency21/r{1,2,3}/fixed.jsonl \
        -o bench/results/latency21/speedup.png       # repeats of one sweep: their runs together
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs

ROOT = Path(__file__).resolve().parents[1]


def measured_speedups(runs) -> dict[str, list[tuple[float, float]]]:
    """{label: [(achieved rate, plain E2E at that rate / this run's E2E)]} for every speculative run
    inside plain decoding's measured rate range."""
    plain = sorted((r.achieved_rate, r.e2e.mean) for r in runs if r.k == 0)
    if len(plain) < 2:
        raise SystemExit("need at least two plain-decoding (k = 0) runs")
    rates, e2e = map(np.array, zip(*plain))
    out: dict[str, list[tuple[float, float]]] = {}
    for r in sorted((r for r in runs if r.k > 0), key=lambda r: (r.k, r.achieved_rate)):
        if rates[0] <= r.achieved_rate <= rates[-1]:
            out.setdefault(r.label, []).append((r.achieved_rate, float(np.interp(r.achieved_rate, rates, e2e)) / r.e2e.mean))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="*", default=[str(ROOT / "bench/results/latency20/fixed.jsonl")])
    p.add_argument("-o", "--output", default=str(ROOT / "docs/speedup_vs_load.png"))
    args = p.parse_args()
    runs = load_runs(args.results)
    points = measured_speedups(runs)
    model = fit_runs(runs, FitOptions(cross_validate=False), args.results).model

    print("| configuration | E | rate (req/s) | measured speedup |\n|---|---|---|---|")
    for label, pts in points.items():
        e = next(c.acceptance_length for c in model.configurations if c.label == label)
        for rate, s in pts:
            print(f"| {label} | {e:.2f} | {rate:.3f} | {s:.2f}x |")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    top = max(r.achieved_rate for r in runs if r.k == 0)
    for conf in (c for c in model.configurations if c.k > 0):
        # up to where this configuration saturates (the model's latency is infinite beyond it)
        grid = np.linspace(0.005, min(top, 0.98 * model.saturation_rate(conf.k, conf.acceptance_length)), 120)
        curve = [model.latency(x, 0, 1.0) / model.latency(x, conf.k, conf.acceptance_length) for x in grid]
        line, = ax.plot(grid, curve, "-", lw=1.2, label=f"k = {conf.k} (E {conf.acceptance_length:.2f})")
        if conf.label in points:
            ax.plot(*zip(*points[conf.label]), "o", ms=4, color=line.get_color())
    ax.axhline(1.0, color="k", lw=1)
    ax.set(xlabel="request rate (req/s)", ylabel="speedup over plain decoding (mean E2E)",
           title=f"Speculative decoding under load ({_name(args.results)})")
    ax.text(0.99, 0.02, "points: measured; lines: latency model fitted on the same runs",
            transform=ax.transAxes, ha="right", va="bottom", fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")


def _name(paths: list[str]) -> str:
    """The sweep's folder name (latency20; latency21 for latency21/r1, r2, r3)."""
    parents = {Path(p).parent for p in paths}
    parent = parents.pop() if len(parents) == 1 else Path(paths[0]).parent.parent
    return parent.name


if __name__ == "__main__":
    main()
