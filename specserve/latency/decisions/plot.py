"""`specserve latency plot`: the collapse plot, latency vs rate per configuration, speedup vs load."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specserve.latency.equations.arrival_regularity import company
from specserve.latency.fitting.fit import FitReport
from specserve.latency.equations.formulas import Demands
from specserve.latency.equations.moe import routed_tokens
from specserve.latency.decisions.planning import break_even_for
from specserve.latency.records.runs import BenchRun


def _is_excluded(report: FitReport, run: BenchRun) -> bool:
    # Match on what the run measured, not on file paths, which differ between invocations.
    return any(x["label"] == run.label and math.isclose(x["achieved_rate"], run.achieved_rate, rel_tol=1e-9)
               and math.isclose(x["e2e_mean_s"], run.e2e.mean, rel_tol=1e-9) for x in report.excluded)


def _point_demands(report: FitReport, conf, run: BenchRun, own: Sequence[BenchRun]) -> Demands:
    """The configuration's own (C1, C2) when its runs share one output length, else the pooled model's at
    the run's own E and length (a per-configuration pair cannot follow lengths that vary from run to run);
    for MoE at the coverage of the run's measured load, which is what puts each point on 1/(1 − x)."""
    lengths = [r.output_tokens for r in own]
    if conf.fit is not None and max(lengths) <= 1.02 * min(lengths):
        model, split = conf.fit, conf.fit.split(conf.k, conf.acceptance_length, conf.output_tokens)
    else:
        model = report.model.e2e
        split = model.split(run.k, run.acceptance_length, run.output_tokens)
    if model.moe is None:
        return split.full
    return split.at(model.moe.coverage(routed_tokens(run.in_flight, conf.k + 1)))


def _collapse(ax, report: FitReport, runs: Sequence[BenchRun]) -> None:
    if report.model.arrival_cv != 1.0:
        return _company_collapse(ax, report, runs)
    x = np.linspace(0, 0.95, 200)
    ax.plot(x, 1 / (1 - x), "k-", lw=1.5, label="y = 1/(1 - x)")
    for conf in report.model.configurations:
        own = [r for r in runs if r.label == conf.label and not _is_excluded(report, r)]
        points = [(r.achieved_rate * d.c2, r.e2e.mean / d.c1)
                  for r, d in ((r, _point_demands(report, conf, r, own)) for r in own)]
        ax.plot([p[0] for p in points], [p[1] for p in points], "o", ms=4, label=conf.label)
    ax.set(xlabel="x = rate x C2", ylabel="y = L / C1", title="Every configuration on one curve")
    ax.legend(fontsize=7)


def _company_collapse(ax, report: FitReport, runs: Sequence[BenchRun]) -> None:
    """Non-Poisson arrivals: L = C1 + C2·company(λL) puts every configuration on y = company(x) with
    x = λ·L in flight and y = (L − C1)/C2, the company each run's latency implies."""
    cv = report.model.arrival_cv
    top = 1.0
    for conf in report.model.configurations:
        own = [r for r in runs if r.label == conf.label and not _is_excluded(report, r)]
        points = [(r.in_flight, (r.e2e.mean - d.c1) / d.c2)
                  for r, d in ((r, _point_demands(report, conf, r, own)) for r in own) if d.c2 > 0]
        if points:
            ax.plot(*zip(*points), "o", ms=4, label=conf.label)
            top = max(top, *(p[0] for p in points))
    x = np.linspace(0, 1.1 * top, 200)
    mixed = "" if report.model.lifetimes.equal else ", the fitted length mix"
    ax.plot(x, company(x, cv, report.model.lifetimes), "k-", lw=1.5, label=f"y = company(x), arrival CV {cv:g}{mixed}")
    ax.plot(x, x, "k:", lw=1, label="y = x (Poisson)")
    ax.set(xlabel="x = rate x L (requests in flight)", ylabel="y = (L - C1) / C2 (company met)",
           title="Every configuration on one curve")
    ax.legend(fontsize=7)


def _latency_vs_rate(ax, report: FitReport, runs: Sequence[BenchRun]) -> None:
    m = report.model
    for conf in m.configurations:
        sat = m.saturation_rate(conf.k, conf.acceptance_length, conf.output_tokens)
        top = min(sat, 1.2 * conf.rate_range[1]) if math.isfinite(sat) else 1.2 * conf.rate_range[1]
        rates = np.linspace(0, 0.98 * top, 120)
        line, = ax.plot(rates, [m.latency(r, conf.k, conf.acceptance_length, conf.output_tokens,
                                          conf.prompt_tokens) for r in rates], "-", label=conf.label)
        own = [r for r in runs if r.label == conf.label]
        kept = [r for r in own if not _is_excluded(report, r)]
        ax.plot([r.achieved_rate for r in kept], [r.e2e.mean for r in kept], "o", color=line.get_color(), ms=4)
        dropped = [r for r in own if _is_excluded(report, r)]
        ax.plot([r.achieved_rate for r in dropped], [r.e2e.mean for r in dropped], "x",
                color=line.get_color(), ms=6)
    measured = [r.e2e.mean for r in runs]
    if measured:  # near saturation the curves shoot up; keep the measured range readable
        ax.set_ylim(0, 1.5 * max(measured))
    ax.set(xlabel="request rate (req/s)", ylabel="mean E2E latency (s)",
           title="Latency vs rate (lines: pooled model; x: excluded)")
    ax.legend(fontsize=7)


def _measured_speedups(report: FitReport, runs: Sequence[BenchRun], conf, dense_c2: float):
    dense = [r for r in runs if r.k == 0 and not _is_excluded(report, r)]
    points = []
    for r in runs:
        if r.label != conf.label or _is_excluded(report, r):
            continue
        match = [d for d in dense if d.offered_rate and r.offered_rate
                 and math.isclose(d.offered_rate, r.offered_rate, rel_tol=0.02)]
        if match:
            points.append((r.achieved_rate * dense_c2, match[0].e2e.mean / r.e2e.mean))
    return points


def _speedup(ax, report: FitReport, runs: Sequence[BenchRun]) -> None:
    m = report.model
    dense_c2 = 1.0 / m.saturation_rate(0, 1.0)  # at full expert coverage for MoE
    # x is the dense load λ·C2_dense; a contention-free baseline (C2 = 0) has none, so use λ itself.
    scale = dense_c2 if dense_c2 > 0 else 1.0
    top = 0.98 if dense_c2 > 0 else 1.2 * max(c.rate_range[1] for c in m.configurations)
    load = np.linspace(0, top, 150)
    for conf in (c for c in m.configurations if c.k > 0):
        ratio = [m.latency(x / scale, 0, 1.0) / m.latency(x / scale, conf.k, conf.acceptance_length) for x in load]
        line, = ax.plot(load, ratio, "-", label=conf.label)
        pts = _measured_speedups(report, runs, conf, scale)
        if pts:
            ax.plot(*zip(*pts), "o", color=line.get_color(), ms=4)
        be = break_even_for(m, conf.k, conf.acceptance_length)
        if be.rate is not None:
            ax.axvline(be.rate * scale, color=line.get_color(), ls=":", lw=1)
    ax.axhline(1.0, color="k", lw=1)
    ax.set(xlabel="dense load r = rate x C2_dense" if dense_c2 > 0 else "request rate (req/s)",
           ylabel="speedup vs plain decoding",
           title="Speedup vs load (dotted: break-even)")
    if ax.get_legend_handles_labels()[0]:  # a dense-only model has no SD curve to label
        ax.legend(fontsize=7)


def plot_all(report: FitReport, runs: Sequence[BenchRun], out_dir: str | Path) -> list[Path]:
    """Write collapse.png, latency_vs_rate.png and speedup_vs_load.png; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (("collapse", _collapse), ("latency_vs_rate", _latency_vs_rate),
                       ("speedup_vs_load", _speedup)):
        fig, ax = plt.subplots(figsize=(6.4, 4.6), dpi=110)
        draw(ax, report, runs)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
