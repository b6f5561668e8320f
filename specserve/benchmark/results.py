"""The results file: one JSON line per run, per-request rows in a side file. Format: docs/bench.md.

`specserve latency fit` reads the run lines; readers ignore keys they do not know, so new keys can be
added without a version change. Removing or redefining a key bumps SCHEMA.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from specserve.errors import SpecServeError

SCHEMA = "specserve.bench.run/1"

# Keys every run line has, with the JSON types they may take (None where the value can be unknown).
# The latency fitter relies on these.
RUN_KEYS = {
    "schema": (str,), "run_id": (str,), "label": (str,), "k": (int, type(None)),
    "server_config": (dict,), "base_url": (str,), "model": (str,), "endpoint": (str,),
    "arrival": (dict,), "offered_rate": (float, int, type(None)), "achieved_rate": (float, int),
    "duration_s": (float, int), "num_requests": (int,), "num_completed": (int,), "num_failed": (int,),
    "mean_prompt_tokens": (float, int, type(None)), "mean_output_tokens": (float, int, type(None)),
    "e2e_s": (dict,), "ttft_s": (dict,), "tpot_s": (dict,), "itl_s": (dict,),
    "mean_in_flight": (float, int, type(None)), "littles_law_in_flight": (float, int, type(None)),
    "in_flight_slope": (float, int, type(None)), "spec": (dict, type(None)),
    "preemptions": (int, type(None)), "slo": (dict, type(None)),
    "slo_attainment": (float, int, type(None)), "goodput_rps": (float, int, type(None)),
    "output_throughput_tps": (float, int), "requests_file": (str,), "started_at": (str,),
}


def clean(value):
    """JSON has no NaN or infinity: write them as null (an unknown value)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def side_path(results_path: str | Path, kind: str) -> Path:
    """`runs/bench.jsonl` keeps its per-request rows in `runs/bench.requests.jsonl` (kind "requests") and a
    sweep's speed probes in `runs/bench.probes.jsonl` (kind "probes")."""
    p = Path(results_path)
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    return p.with_name(f"{stem}.{kind}.jsonl")


def requests_path(results_path: str | Path) -> Path:
    return side_path(results_path, "requests")


def validate_run(record: dict) -> list[str]:
    """What is wrong with a run line (empty when it is valid)."""
    problems = []
    for key, types in RUN_KEYS.items():
        if key not in record:
            problems.append(f"missing {key}")
        elif not isinstance(record[key], types) or (isinstance(record[key], bool) and bool not in types):
            problems.append(f"{key} has type {type(record[key]).__name__}")
    if record.get("schema", "").split("/")[0] != SCHEMA.split("/")[0]:
        problems.append(f"schema {record.get('schema')!r} is not {SCHEMA!r}")
    return problems


def append_run(results_path: str | Path, record: dict, rows: list[dict]) -> None:
    results_path = Path(results_path)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    side = requests_path(results_path)
    record = clean(dict(record, requests_file=side.name))
    problems = validate_run(record)
    if problems:   # a bug in the benchmark, not a user error: never write a line the fitter cannot read
        raise AssertionError(f"invalid run record: {problems}")
    with open(side, "a") as f:
        for row in rows:
            f.write(json.dumps(clean(dict(row, run=record["run_id"])), allow_nan=False) + "\n")
    with open(results_path, "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read_runs(results_path: str | Path) -> list[dict]:
    path = Path(results_path)
    if not path.is_file():
        raise SpecServeError(f"results file {path} not found")
    runs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecServeError(f"{path}:{n}: not JSON ({e})") from None
        if str(record.get("schema", "")).split("/")[0] != SCHEMA.split("/")[0]:
            raise SpecServeError(f"{path}:{n}: not a specserve bench run (schema {record.get('schema')!r})")
        runs.append(record)
    return runs


def read_request_rows(results_path: str | Path) -> dict[str, list[dict]]:
    """Per-request rows grouped by run id; empty when the side file is missing."""
    rows: dict[str, list[dict]] = {}
    runs = read_runs(results_path)
    files = {Path(results_path).with_name(r.get("requests_file") or requests_path(results_path).name)
             for r in runs}
    for side in files:
        if not side.is_file():
            continue
        for line in side.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows.setdefault(row.get("run", ""), []).append(row)
    return rows
