"""Per-request rows of a bench run (the side file named in `requests_file`).

The fit itself needs only run summaries; the rows add what summaries cannot give: the traffic's length
distribution (length classes) and the prefill cost per prompt token.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.latency.runs import BenchRun


@dataclass(slots=True)
class RequestSample:
    """Successful requests of one run."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft: np.ndarray

    def __len__(self) -> int:
        return len(self.prompt_tokens)


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


def load_request_sample(run: BenchRun) -> tuple[RequestSample | None, str | None]:
    """The run's successful rows, or (None, why not). Rows are optional input, so problems are notes."""
    if not run.requests_path:
        return None, f"{run.source}: no requests_file"
    try:
        rows = _rows(Path(run.requests_path))
    except (OSError, json.JSONDecodeError) as e:
        return None, f"{run.source}: cannot read {run.requests_path} ({e})"
    keys = {str(r.get("run")) for r in rows if r.get("run") is not None}
    if run.run_key is not None:
        rows = [r for r in rows if str(r.get("run")) == run.run_key]
    elif len(keys) > 1:
        # A shared side file with no way to tell which rows are this run's: using them would mix runs.
        return None, f"{run.source}: {run.requests_path} holds several runs and the record names none"
    good = [r for r in rows if r.get("measured", True) and not r.get("error") and _prompt(r) is not None
            and all(isinstance(r.get(key), (int, float)) for key in ("output_tokens", "ttft_s"))]
    if not good:
        return None, f"{run.source}: no successful request rows"
    return RequestSample(prompt_tokens=np.array([_prompt(r) for r in good], dtype=float),
                         output_tokens=np.array([r["output_tokens"] for r in good], dtype=float),
                         ttft=np.array([r["ttft_s"] for r in good], dtype=float)), None


def _prompt(row: dict) -> float | None:
    """The server's prompt token count, else the client's estimate (servers without usage stats)."""
    for key in ("prompt_tokens", "est_prompt_tokens"):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None
