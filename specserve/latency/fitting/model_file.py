"""model.json: a fitted model with its intervals, fit quality, cross-validation and exclusions.

Versioned by `schema`; readers refuse other major versions rather than misread coefficients. Non-finite
numbers (an R² over constant data, an infinite error) are written as null so the file stays strict JSON.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.latency.fitting.colocation import Colocation
from specserve.latency.equations.slots import check_slots
from specserve.latency.fitting.e2e import E2EModel
from specserve.latency.fitting.fit import FitReport
from specserve.latency.equations.lengths import LengthClass
from specserve.latency.fitting.model import Configuration, LatencyModel
from specserve.latency.equations.moe import MoeExperts
from specserve.latency.fitting.phases import PhaseModel
from specserve.latency.fitting.regression import FittedCoefficients, RowSpace
from specserve.latency.fitting.tails import TailModel

MODEL_SCHEMA = "specserve.latency.model/1"


def finite_json(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _nan(value) -> float:
    return math.nan if value is None else float(value)


def _coefficients(c: FittedCoefficients) -> dict:
    return {"values": c.values, "ci95": {k: None if v is None else list(v) for k, v in c.ci95.items()},
            "not_identifiable": list(c.not_identifiable), "n_points": c.n_points, "r2": c.r2,
            "mape_percent": c.mape,
            "covariance": None if c.covariance is None else [list(row) for row in c.covariance]}


def _read_coefficients(d: dict) -> FittedCoefficients:
    return FittedCoefficients({k: float(v) for k, v in d["values"].items()},
                              {k: None if v is None else (float(v[0]), float(v[1])) for k, v in d["ci95"].items()},
                              tuple(d["not_identifiable"]), int(d["n_points"]), _nan(d["r2"]),
                              _nan(d["mape_percent"]),
                              # absent from files written before plans carried the fit's uncertainty
                              None if d.get("covariance") is None else
                              tuple(tuple(float(x) for x in row) for row in d["covariance"]))


def _space(s: RowSpace) -> dict:
    return {"scale": list(s.scale), "basis": [list(r) for r in s.basis]}


def _read_space(d: dict) -> RowSpace:
    return RowSpace(tuple(d["scale"]), tuple(tuple(r) for r in d["basis"]))


def _e2e(m: E2EModel) -> dict:
    return {**_coefficients(m.coefficients), "feature_space": _space(m.space), "arrival_cv": m.arrival_cv,
            **({} if m.slots is None else {"slots": m.slots})}


def _read_e2e(d: dict, moe: MoeExperts | None, pooled: bool) -> E2EModel:
    # Files written before the arrival correction assumed Poisson arrivals (cv 1); without "slots", no cap.
    return E2EModel(_read_coefficients(d), moe, _read_space(d["feature_space"]), pooled,
                    float(d.get("arrival_cv", 1.0)), check_slots(d.get("slots")))


def to_dict(report: FitReport) -> dict:
    m = report.model
    moe = m.e2e.moe
    return finite_json({
        "schema": MODEL_SCHEMA,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "sources": report.sources,
        "reference": {"prompt_tokens": m.prompt_tokens, "output_tokens": m.output_tokens},
        "prefill_per_token_s": m.prefill_per_token,
        "draft_catch_up_s": m.draft_catch_up,
        "moe": None if moe is None else {"active": moe.active, "experts": moe.experts},
        "e2e": _e2e(m.e2e),
        "ttft": {**_coefficients(m.ttft.coefficients), "base_space": _space(m.ttft.base_space),
                 "load_space": _space(m.ttft.load_space)},
        "tpot": {**_coefficients(m.tpot.coefficients), "base_space": _space(m.tpot.base_space),
                 "load_space": _space(m.tpot.load_space)},
        "tails": {metric: {q: _coefficients(c) for q, c in by_q.items()}
                  for metric, by_q in m.tails.coefficients.items()},
        "length_classes": [{"prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
                            "weight": c.weight} for c in m.length_classes],
        "configurations": [{
            "label": c.label, "k": c.k, "acceptance_length": c.acceptance_length, "alpha": c.alpha,
            "alphas_by_position": None if c.alphas_by_position is None else list(c.alphas_by_position),
            "prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
            "rate_range": list(c.rate_range), "n_runs": c.n_runs,
            "fit": None if c.fit is None else _e2e(c.fit)} for c in m.configurations],
        "quality": report.quality,
        "cross_validation": report.cross_validation,
        "excluded": report.excluded,
        "notes": report.notes,
    })


def from_dict(d: dict) -> FitReport:
    schema = str(d.get("schema", ""))
    if not schema.startswith("specserve.latency.model/"):
        raise SpecServeError(f"not a latency model file (schema {schema!r})")
    if schema != MODEL_SCHEMA:
        raise SpecServeError(f"latency model version {schema!r} is not supported (this is {MODEL_SCHEMA})")
    moe = None if d["moe"] is None else MoeExperts(int(d["moe"]["active"]), int(d["moe"]["experts"]))
    phases = {metric: PhaseModel(metric, _read_coefficients(d[metric]), _read_space(d[metric]["base_space"]),
                                 _read_space(d[metric]["load_space"])) for metric in ("ttft", "tpot")}
    configurations = tuple(Configuration(
        c["label"], int(c["k"]), float(c["acceptance_length"]), c["alpha"],
        None if c["alphas_by_position"] is None else tuple(c["alphas_by_position"]),
        float(c["prompt_tokens"]), float(c["output_tokens"]), tuple(c["rate_range"]), int(c["n_runs"]),
        None if c["fit"] is None else _read_e2e(c["fit"], moe, pooled=False)) for c in d["configurations"])
    model = LatencyModel(
        e2e=_read_e2e(d["e2e"], moe, pooled=True), ttft=phases["ttft"], tpot=phases["tpot"],
        tails=TailModel({metric: {q: _read_coefficients(c) for q, c in by_q.items()}
                         for metric, by_q in d["tails"].items()}),
        prompt_tokens=float(d["reference"]["prompt_tokens"]), output_tokens=float(d["reference"]["output_tokens"]),
        prefill_per_token=d["prefill_per_token_s"],
        length_classes=tuple(LengthClass(**c) for c in d["length_classes"]), configurations=configurations,
        # absent from files written before TPOT counted the draft's catch-up: their TPOT had none
        draft_catch_up=d.get("draft_catch_up_s"))
    return FitReport(model, d["excluded"], d["notes"], d["quality"], d["cross_validation"], d["sources"])


def save(report: FitReport, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(report), indent=1) + "\n")


def _read(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise SpecServeError(f"cannot read model file {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise SpecServeError(f"{path}: not JSON ({e.msg})") from None


def load(path: str | Path) -> FitReport:
    data = _read(path)
    try:
        return from_dict(data)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecServeError(f"{path}: malformed latency model ({type(e).__name__}: {e})") from None


# The co-location term (colocation.py) is an optional part: factors on this fit's C1 and C2, so it lives
# in the fit's own file; files without it plan replicas as independent copies of the fit.
def save_colocation(path: str | Path, colocation: Colocation) -> None:
    data = _read(path)
    data["colocation"] = finite_json(colocation.to_dict())
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_colocation(path: str | Path) -> Colocation | None:
    part = _read(path).get("colocation")
    try:
        return None if part is None else Colocation.from_dict(part)
    except (KeyError, TypeError, ValueError) as e:
        raise SpecServeError(f"{path}: malformed co-location term ({type(e).__name__}: {e})") from None
