"""`specserve bench report`: PNG plots of a results file and one self-contained HTML page embedding them."""
from __future__ import annotations

import base64
import html
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from specserve.benchmark.metrics import in_flight_steps
from specserve.benchmark.results import read_request_rows, read_runs
from specserve.benchmark.table import notes
from specserve.errors import SpecServeError


def _plt():
    import matplotlib

    matplotlib.use("Agg")   # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def _by_label(runs: list[dict]) -> dict[str, list[dict]]:
    groups = defaultdict(list)
    for r in runs:
        groups[r["label"]].append(r)
    for g in groups.values():
        g.sort(key=lambda r: r.get("achieved_rate") or 0.0)
    return dict(groups)


def _stat(r: dict, key: str, s: str) -> float:
    v = (r.get(key) or {}).get(s)
    return np.nan if v is None else v


def _style(ax, xlabel: str, ylabel: str, title: str, legend_size: int = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend_size)


def _save(plt, fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency_vs_rate(groups, path):
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for n, (ax, (key, name)) in enumerate(zip(axes, (("ttft_s", "TTFT"), ("tpot_s", "TPOT"),
                                                     ("e2e_s", "E2E latency")))):
        for i, (label, runs) in enumerate(groups.items()):
            x = [r["achieved_rate"] for r in runs]
            color = f"C{i % 10}"
            ax.plot(x, [_stat(r, key, "mean") * 1000 for r in runs], "o-", color=color, label=f"{label} mean")
            ax.plot(x, [_stat(r, key, "p99") * 1000 for r in runs], "s--", color=color, alpha=0.6,
                    label=f"{label} p99")
        _style(ax, "achieved rate (req/s)", f"{name} (ms)", f"{name} vs request rate")
        if n:   # one legend is enough: the three panels share their lines
            ax.get_legend().remove()
    _save(plt, fig, path)


def _per_label_points(groups, path, xy, xlabel, ylabel, title, diagonal=None, ylim=None):
    """One marker line per configuration of points xy(run) -> (x, y) or None; optional y = x line."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    top = 0.0
    for i, (label, runs) in enumerate(groups.items()):
        pts = sorted(p for p in (xy(r) for r in runs) if p is not None and None not in p)
        if pts:
            x, y = zip(*pts)
            ax.plot(x, y, "o-" if diagonal != "B = λ·L" else "o", color=f"C{i % 10}", label=label)
            top = max(top, *x, *y)
    if diagonal:
        ax.plot([0, top or 1], [0, top or 1], "k:", lw=1, label=diagonal)
    if ylim:
        ax.set_ylim(*ylim)
    _style(ax, xlabel, ylabel, title)
    _save(plt, fig, path)


def plot_throughput(groups, path):
    _per_label_points(groups, path, lambda r: (r.get("offered_rate"), r["achieved_rate"]),
                      "offered rate (req/s)", "achieved rate (req/s)", "achieved vs offered rate",
                      diagonal="achieved = offered")


def plot_slo(groups, path):
    _per_label_points(groups, path, lambda r: (r["achieved_rate"], None if r.get("slo_attainment") is None
                                               else 100 * r["slo_attainment"]),
                      "achieved rate (req/s)", "requests meeting the SLO (%)", "SLO attainment vs request rate",
                      ylim=(-3, 103))


def plot_draft_length(groups, path):
    _per_label_points(groups, path, lambda r: (r["achieved_rate"], (r.get("policy") or {}).get("mean_draft_length")),
                      "achieved rate (req/s)", "mean draft length per request and step",
                      "Draft length the speculation policy chose vs load")


def plot_littles_law(groups, path):
    _per_label_points(groups, path, lambda r: (r.get("littles_law_in_flight"), r.get("mean_in_flight")),
                      "λ·L (achieved rate × mean E2E)", "measured mean requests in flight",
                      "Little's law check", diagonal="B = λ·L")


def _per_run_panels(groups, rows, path, draw, xlabel, ylabel, title):
    """One panel per configuration, one line per run coloured by rate: draw(ax, rows, color, label)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 4), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, (label, runs) in zip(axes[0], groups.items()):
        for j, r in enumerate(runs):
            draw(ax, rows.get(r["run_id"], []), cmap(j / max(1, len(runs) - 1)),
                 f"{r['achieved_rate']:.2f} req/s")
        _style(ax, xlabel, ylabel, f"{title} — {label}", legend_size=7)
    _save(plt, fig, path)


def plot_cdfs(groups, rows, key, name, path):
    def draw(ax, run_rows, color, label):
        v = np.sort([x[key] for x in run_rows if x.get("measured", True) and x.get(key) is not None]) * 1000
        if v.size:
            ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", color=color, label=label)

    _per_run_panels(groups, rows, path, draw, f"{name} (ms)", "fraction of requests", f"{name} CDF")


def plot_in_flight(groups, rows, path):
    def draw(ax, run_rows, color, label):
        t, n = in_flight_steps([(x["sent_s"], x["end_s"]) for x in run_rows
                                if x.get("sent_s") is not None and x.get("end_s") is not None])
        if t.size:
            ax.step(t, n, where="post", color=color, lw=1, label=label)

    _per_run_panels(groups, rows, path, draw, "time since run start (s)", "requests in flight",
                    "in flight over time")


def _fmt(v, scale=1.0, digits=2):
    return "–" if v is None else f"{v * scale:.{digits}f}"


def _table(runs: list[dict]) -> str:
    head = ("label", "k", "process", "offered (req/s)", "achieved (req/s)", "completed/failed",
            "TTFT p50/p99 (ms)", "TPOT p50/p99 (ms)", "ITL p50 (ms)", "E2E mean/p99 (s)", "in flight",
            "λ·L", "slope", "SLO met", "goodput (req/s)", "accept len", "preempt")
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for r in runs:
        spec = r.get("spec") or {}
        cells = (r["label"], r.get("k"), r["arrival"]["process"], _fmt(r.get("offered_rate")),
                 _fmt(r.get("achieved_rate")), f"{r['num_completed']}/{r['num_failed']}",
                 f"{_fmt(r['ttft_s']['median'], 1000, 0)}/{_fmt(r['ttft_s']['p99'], 1000, 0)}",
                 f"{_fmt(r['tpot_s']['median'], 1000, 1)}/{_fmt(r['tpot_s']['p99'], 1000, 1)}",
                 _fmt(r["itl_s"]["median"], 1000, 1),
                 f"{_fmt(r['e2e_s']['mean'])}/{_fmt(r['e2e_s']['p99'])}", _fmt(r.get("mean_in_flight")),
                 _fmt(r.get("littles_law_in_flight")), _fmt(r.get("in_flight_slope"), 1, 3),
                 _fmt(r.get("slo_attainment"), 100, 1) + ("%" if r.get("slo_attainment") is not None else ""),
                 _fmt(r.get("goodput_rps")), _fmt(spec.get("mean_acceptance_length")),
                 "–" if r.get("preemptions") is None else r["preemptions"])
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;
font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}th{background:#f3f3f3}
img{max-width:100%;margin:1em 0;border:1px solid #eee}.note{color:#8a5a00}code{background:#f5f5f5}"""


def write_report(results_path: str, out_dir: str | None = None) -> Path:
    """Write the PNGs and report.html into `out_dir` (default: next to the results); returns the HTML path."""
    runs = read_runs(results_path)
    if not runs:
        raise SpecServeError(f"{results_path} has no runs")
    rows = read_request_rows(results_path)
    out = Path(out_dir) if out_dir else Path(results_path).with_name(Path(results_path).stem + "_report")
    out.mkdir(parents=True, exist_ok=True)
    groups = _by_label(runs)
    figures = [("latency_vs_rate.png", "Latency vs request rate (mean solid, p99 dashed)",
                lambda p: plot_latency_vs_rate(groups, p)),
               ("throughput_vs_rate.png", "Achieved vs offered rate", lambda p: plot_throughput(groups, p))]
    if any(r.get("slo_attainment") is not None for r in runs):
        figures.append(("slo_attainment_vs_rate.png", "SLO attainment vs request rate",
                        lambda p: plot_slo(groups, p)))
    if any((r.get("policy") or {}).get("mean_draft_length") is not None for r in runs):
        figures.append(("draft_length_vs_rate.png", "Chosen draft length vs load (specserve's policy)",
                        lambda p: plot_draft_length(groups, p)))
    figures += [("ttft_cdf.png", "TTFT distribution", lambda p: plot_cdfs(groups, rows, "ttft_s", "TTFT", p)),
                ("tpot_cdf.png", "TPOT distribution", lambda p: plot_cdfs(groups, rows, "tpot_s", "TPOT", p)),
                ("in_flight_over_time.png", "Requests in flight over time",
                 lambda p: plot_in_flight(groups, rows, p)),
                ("littles_law.png", "Little's law: measured in-flight vs λ·L",
                 lambda p: plot_littles_law(groups, p))]
    sections = []
    for name, title, draw in figures:
        draw(out / name)
        data = base64.b64encode((out / name).read_bytes()).decode()
        sections.append(f"<h2>{html.escape(title)}</h2><img alt='{name}' src='data:image/png;base64,{data}'>")
    run_notes = [f"<li><b>{html.escape(r['label'])}</b> @ {_fmt(r.get('offered_rate'))} req/s: "
                 f"{html.escape(n)}</li>" for r in runs for n in notes(r)]
    slos = {str(r["slo"]) for r in runs if r.get("slo")}
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>specserve bench report</title>
<style>{_CSS}</style></head><body>
<h1>specserve bench report</h1>
<p>Results: <code>{html.escape(str(results_path))}</code> — {len(runs)} runs, configurations:
{html.escape(', '.join(groups))}. Generated {datetime.now(timezone.utc).isoformat(timespec='seconds')}.
{('SLO: ' + html.escape('; '.join(sorted(slos)))) if slos else ''}</p>
{_table([r for g in groups.values() for r in g])}
{'<h2>Notes</h2><ul class="note">' + ''.join(run_notes) + '</ul>' if run_notes else ''}
{''.join(sections)}
<p>Definitions: TTFT = first text − sent; TPOT = (E2E − TTFT)/(output tokens − 1); ITL = gap between
streamed chunks; achieved rate = completions inside the measured window / window length; in flight =
time-average count of requests in flight in that window; slope &gt; 0 means the queue grows.</p>
</body></html>"""
    html_path = out / "report.html"
    html_path.write_text(page)
    return html_path
