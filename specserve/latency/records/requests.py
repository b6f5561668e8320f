"""Per-request rows of a bench run (the side file named in `requests_file`).

The fit itself needs only run summaries; the rows add what summaries cannot give: the traffic's length
distribution (length classes), the prefill cost per prompt token, how much of a run's E2E spread is
noise rather than its requests' own lengths, and the company requests actually kept (arrivals.py).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.latency.records.runs import BenchRun


@dataclass(slots=True)
class RequestSample:
    """Successful requests of one run."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft: np.ndarray
    e2e: np.ndarray  # NaN where a row lacks it
    company: float | None = None  # measured co-residents over the requests' lifetimes (lifetime_company)
    first_gap_excess: np.ndarray | None = None  # per request: first inter-token gap minus the mean of the
    # later ones (NaN where a row has fewer than 3 gaps); with SD, the draft's catch-up over the prompt


    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def e2e_noise_std(self) -> float | None:
        """Spread of E2E that the requests' own output lengths do not explain: the residual std of a
        least-squares line E2E = a + b·g over the run's requests (n − 2 degrees of freedom). The model
        predicts a run's mean E2E at the run's mean output length, so only this part of the spread is
        sampling noise of that prediction. None with fewer than 4 requests, no E2E, or one length."""
        n = len(self)
        if n < 4 or np.isnan(self.e2e).any() or np.ptp(self.output_tokens) == 0:
            return None
        X = np.column_stack([np.ones(n), self.output_tokens])
        coef, *_ = np.linalg.lstsq(X, self.e2e, rcond=None)
        residual = self.e2e - X @ coef
        return float(np.sqrt(residual @ residual / (n - 2)))


def rows_by_run(path: Path) -> dict[str | None, list[dict]]:
    """A per-request side file's rows, grouped by the run each names ("run"; None where a row names none)."""
    rows: dict[str | None, list[dict]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if isinstance(row, dict):
                run = row.get("run")
                rows.setdefault(None if run is None else str(run), []).append(row)
    return rows


def _sample(rows: list[dict]) -> RequestSample | None:
    good = [r for r in rows if r.get("measured", True) and not r.get("error") and _prompt(r) is not None
            and all(isinstance(r.get(key), (int, float)) for key in ("output_tokens", "ttft_s"))]
    if not good:
        return None
    return RequestSample(prompt_tokens=np.array([_prompt(r) for r in good], dtype=float),
                         output_tokens=np.array([r["output_tokens"] for r in good], dtype=float),
                         ttft=np.array([r["ttft_s"] for r in good], dtype=float),
                         e2e=np.array([r.get("e2e_s", np.nan) for r in good], dtype=float),
                         company=lifetime_company(rows),
                         first_gap_excess=np.array([_first_gap_excess(r) for r in good], dtype=float))


def _first_gap_excess(row: dict) -> float:
    gaps = row.get("itl_s")
    if not isinstance(gaps, list) or len(gaps) < 3:
        return float("nan")
    return float(gaps[0] - np.mean(gaps[1:]))


def lifetime_company(rows: list[dict]) -> float | None:
    """The time-average number of other requests in flight during the measured requests' lifetimes (sent
    to end), pooled over them (lifetime-weighted, as the latency model's company is: arrivals.py),
    counting every request of the run as company, warm-up ones too. None when rows lack the times."""
    spans = [(r.get("sent_s", r.get("arrival_s")), r.get("end_s"), r.get("measured", True)) for r in rows
             if not r.get("error")]
    spans = [(a, b, m) for a, b, m in spans if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > a]
    start, end = (np.array([s[i] for s in spans], dtype=float) for i in (0, 1))
    measured = np.array([s[2] for s in spans], dtype=bool)
    if not measured.any():
        return None
    a, b = start[measured, None], end[measured, None]
    shared = np.clip(np.minimum(b, end[None, :]) - np.maximum(a, start[None, :]), 0.0, None).sum(axis=1)
    life = (b - a)[:, 0]
    return float(np.sum(shared - life) / np.sum(life))  # less its own lifetime


def load_request_samples(runs: Sequence[BenchRun]) -> tuple[dict[str, RequestSample], list[str]]:
    """{run.source: its successful rows} and notes on runs whose rows could not be used. Rows are optional
    input, so problems are notes, not errors. Each side file is read once: specserve bench shares one
    between all runs of a results file and names the run in each row's "run" field."""
    samples: dict[str, RequestSample] = {}
    notes: list[str] = []
    by_file: dict[str, list[BenchRun]] = {}
    for run in runs:
        if run.requests_path:
            by_file.setdefault(run.requests_path, []).append(run)
    for path, group in by_file.items():
        try:
            rows = rows_by_run(Path(path))
        except (OSError, json.JSONDecodeError) as e:
            notes.append(f"per-request rows unused: cannot read {path} ({e})")
            continue
        for run in group:
            if run.run_key is not None:
                mine = rows.get(run.run_key, [])
            elif len(rows) == 1:
                mine = next(iter(rows.values()))
            else:  # a shared file and no way to tell this run's rows: using them would mix runs
                notes.append(f"per-request rows unused: {path} holds several runs and {run.source} names none")
                continue
            sample = _sample(mine)
            if sample is None:
                notes.append(f"per-request rows unused: no successful rows for {run.source} in {path}")
            else:
                samples[run.source] = sample
    return samples, notes


def _prompt(row: dict) -> float | None:
    """The server's prompt token count, else the client's estimate (servers without usage stats)."""
    for key in ("prompt_tokens", "est_prompt_tokens"):
        if isinstance(row.get(key), (int, float)):
            return float(row[key])
    return None
