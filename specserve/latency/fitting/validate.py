"""Held-out validation tables (issue 8's acceptance test): fit on all but one rate / one configuration,
predict the held-out runs, and report MAPE of E2E, TTFT and TPOT means (and E2E p95/p99)."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.latency.fitting.fit import FitOptions, FitReport, fit_runs
from specserve.latency.records.runs import load_runs

# Mean-E2E MAPE goals from the issue: held-out rates ≤ 5%, held-out k ≤ 8% (a configuration is one
# (α, k); held out alone it is at least as hard as its k, whose other configurations stay in training).
GOALS = {"rate": 5.0, "configuration": 8.0, "k": 8.0}
TITLES = {"rate": "Held-out rates (leave one rate out)",
          "configuration": "Held-out configurations (leave one (alpha, k) out)",
          "k": "Held-out k (every configuration with that k left out)"}
# Mean TTFT and TPOT MAPE goal (issue 81), held-out rates and configurations alike.
PHASE_GOAL = 8.0
# The measurement's own noise beside the model's error: the held-out runs' standard error of each mean
# (for E2E from the spread their requests' own output lengths do not explain, where per-request rows exist).
SE_COLUMNS = (("e2e", "E2E noise (SE)"), ("ttft", "TTFT noise (SE)"), ("tpot", "TPOT noise (SE)"))
# A perfect model's expected absolute error when the measured mean scatters normally with standard error
# SE: SE·sqrt(2/π). Where it exceeds a goal, the runs cannot show the goal met.
NOISE_MAPE = math.sqrt(2 / math.pi)
# The mean signed E2E error (crossval.summarize): near the MAPE in size, the model misses one way.
BIAS_COLUMN = "E2E bias"
# With several results files of one sweep design: the error at each design point's average over the
# repeats, and the repeats' own scatter (crossval.repeats), which also counts drift between runs.
REPEAT_COLUMNS = ("E2E MAPE, repeats averaged", "repeat noise")
COLUMNS = (("e2e", "E2E"), ("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e_p95", "E2E p95"), ("e2e_p99", "E2E p99"))


def validate_files(paths: Sequence[str | Path], options: FitOptions | None = None,
                   k_overrides: Mapping[str, int] | None = None,
                   alpha_overrides: Mapping[str, float] | None = None) -> FitReport:
    """Fit the results files and cross-validate (the report's `cross_validation` holds the tables)."""
    options = options or FitOptions()
    if not options.cross_validate:
        raise SpecServeError("validation needs cross-validation enabled")
    unusable: list[dict] = []
    runs = load_runs(paths, k_overrides, alpha_overrides, unusable)
    return fit_runs(runs, options, [str(p) for p in paths], unusable)


def _percent(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}%"


def _cell(mape: dict, key: str) -> str:
    return _percent(mape.get(key, {}).get("mape"))


def _signed(mape: dict) -> str:
    bias = mape.get("e2e", {}).get("bias")
    return _percent(bias) if bias is None or math.isinf(bias) else f"{bias:+.2f}%"


def _repeat_cells(row: dict) -> list[str]:
    rep = row.get("repeats") or {}
    return [_percent(rep.get("mape")), _percent(rep.get("noise"))]


def header(result: dict) -> list[str]:
    return (["held out", "runs"] + [name + " MAPE" for _, name in COLUMNS] + [BIAS_COLUMN]
            + [name for _, name in SE_COLUMNS]
            + (list(REPEAT_COLUMNS) if result.get("repeats") else []))


def rows(result: dict) -> list[list[str]]:
    """Table rows: one per held-out group, then the overall row."""
    extra = _repeat_cells if result.get("repeats") else (lambda row: [])
    out = [[g["held_out"], str(g["n"])] + [_cell(g["mape"], key) for key, _ in COLUMNS]
           + [_signed(g["mape"])] + _noise_cells(g) + extra(g) for g in result["groups"]]
    n = sum(g["n"] for g in result["groups"])
    out.append(["all held-out points", str(n)] + [_cell(result["overall"], key) for key, _ in COLUMNS]
               + [_signed(result["overall"])] + _noise_cells(result) + extra(result))
    return out


def _noise_cells(row: dict) -> list[str]:
    se = row.get("se") or {}
    return [_percent(se.get(metric)) for metric, _ in SE_COLUMNS]


def goal_line(by: str, result: dict) -> str:
    value = result["overall"].get("e2e", {}).get("mape")
    if value is None:
        return f"goal: mean E2E MAPE <= {GOALS[by]:g}%: not measurable (no held-out predictions)"
    verdict = "met" if value <= GOALS[by] else "MISSED"
    line = f"goal: mean E2E MAPE <= {GOALS[by]:g}%: {verdict} ({value:.2f}%)"
    rep = result.get("repeats")
    if rep:
        verdict = "met" if rep["mape"] <= GOALS[by] else "MISSED"
        line += (f"; at the averages of repeated points: {verdict} ({rep['mape']:.2f}% over {rep['points']} "
                 f"points, repeat noise {rep['noise']:.2f}%)")
    return line


def phase_goal_line(result: dict) -> str:
    """TTFT's and TPOT's goal, each beside the MAPE the runs' own noise would leave a perfect model."""
    parts = []
    for metric, name in (("ttft", "TTFT"), ("tpot", "TPOT")):
        value, se = result["overall"].get(metric, {}).get("mape"), (result.get("se") or {}).get(metric)
        if value is None:
            parts.append(f"{name}: not measurable")
            continue
        text = f"{name}: {'met' if value <= PHASE_GOAL else 'MISSED'} ({value:.2f}%"
        if se is not None:
            floor = se * NOISE_MAPE
            text += (f"; noise alone gives a perfect model {floor:.2f}%, "
                     + ("above the goal: the runs cannot show it met" if floor > PHASE_GOAL else "within the goal"))
        parts.append(text + ")")
    return f"goal: mean TTFT and TPOT MAPE <= {PHASE_GOAL:g}%: " + "; ".join(parts)


def markdown(report: FitReport) -> str:
    """The tables as Markdown, for a document (e.g. bench/results/*/validate.md)."""
    parts = []
    for by, result in report.cross_validation.items():
        names = header(result)
        parts += [f"**{TITLES[by]}**", "", "| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
        parts += ["| " + " | ".join(r) + " |" for r in rows(result)]
        parts += ["", goal_line(by, result)] + ([phase_goal_line(result)] if by != "k" else []) + [""]
    return "\n".join(parts)


def render(report: FitReport, out=None) -> None:
    """Print the tables with rich (notes on held-out groups a metric could not be predicted for) to the
    console `out` (default: stdout, never truncated)."""
    from rich.table import Table

    from specserve.console import console

    out = out or console()
    for by, result in report.cross_validation.items():
        table = Table(title=TITLES[by])
        for i, name in enumerate(header(result)):
            table.add_column(name, justify="left" if i == 0 else "right")
        body = rows(result)
        for i, row in enumerate(body):
            table.add_row(*row, end_section=i == len(body) - 2)
        out.print(table)
        out.print(goal_line(by, result))
        if by != "k":
            out.print(phase_goal_line(result))
        for g in result["groups"]:
            if g.get("note"):
                out.print(f"  {g['held_out']}: {g['note']}")
