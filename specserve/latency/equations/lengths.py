"""Mixed-length traffic: length classes weighted by a trace's distribution, and the prefill cost per token.

The pooled model is linear in a request's own output length g (cycles = g/E) and, through the prefill
slope, in its own prompt length p. For a mix of classes i with weights w_i sharing one population in flight
B = λ·L_mix, each class sees L_i = C1(p_i, g_i) + B·C2(g_i), and L_mix = Σ w_i·L_i.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.errors import SpecServeError


@dataclass(frozen=True, slots=True)
class LengthClass:
    prompt_tokens: float
    output_tokens: float
    weight: float  # fraction of requests

    def __post_init__(self) -> None:
        if not (self.prompt_tokens >= 0 and self.output_tokens >= 1 and 0 < self.weight <= 1):
            raise SpecServeError(f"invalid length class {self}")


def length_classes(prompt_tokens: Sequence[float], output_tokens: Sequence[float],
                   n_classes: int = 4) -> tuple[LengthClass, ...]:
    """Quantile bins of output length (what drives E2E), each with its mean prompt and output length."""
    p, g = np.asarray(prompt_tokens, float), np.asarray(output_tokens, float)
    if p.size == 0 or p.size != g.size:
        raise SpecServeError("length classes need matching, non-empty prompt and output lengths")
    if n_classes < 1:
        raise SpecServeError(f"number of length classes must be >= 1, got {n_classes}")
    edges = np.unique(np.quantile(g, np.linspace(0, 1, n_classes + 1)))
    which = np.clip(np.searchsorted(edges, g, side="right") - 1, 0, max(len(edges) - 2, 0))
    classes = []
    for c in np.unique(which):
        mask = which == c
        classes.append(LengthClass(float(p[mask].mean()), max(float(g[mask].mean()), 1.0),
                                   float(mask.mean())))
    return tuple(classes)


def prefill_slope(groups: Sequence[tuple[np.ndarray, np.ndarray]]) -> float | None:
    """Seconds of TTFT per prompt token: the within-run slope of TTFT on prompt length, pooled over runs
    (each run centred on its own means, so load differences between runs do not leak into the slope).
    None when prompt lengths never vary within a run."""
    sxx = sxy = 0.0
    for p, t in groups:
        if len(p) < 2:
            continue
        dp = p - p.mean()
        sxx += float(dp @ dp)
        sxy += float(dp @ (t - t.mean()))
    if sxx == 0.0:
        return None
    return max(sxy / sxx, 0.0)  # a longer prompt never prefills faster; a negative slope is noise


def read_lengths(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(prompt, output) token counts from bench per-request JSONL rows or a CSV trace with columns
    prompt_tokens/output_tokens or the Azure trace's ContextTokens/GeneratedTokens."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecServeError(f"cannot read lengths file {path}: {e.strerror}") from None
    pairs: list[tuple[float, float]] = []
    if path.suffix == ".csv":
        for row in csv.DictReader(text.splitlines()):
            p = row.get("prompt_tokens", row.get("ContextTokens"))
            g = row.get("output_tokens", row.get("GeneratedTokens"))
            if p is None or g is None:
                raise SpecServeError(f"{path}: needs columns prompt_tokens,output_tokens "
                                     "(or ContextTokens,GeneratedTokens)")
            pairs.append((float(p), float(g)))
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not row.get("error"):
                    pairs.append((float(row["prompt_tokens"]), float(row["output_tokens"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
                raise SpecServeError(f"{path}:{number}: not a request row with prompt_tokens, "
                                     "output_tokens") from None
    if not pairs:
        raise SpecServeError(f"{path}: no request lengths found")
    p, g = np.array(pairs).T
    return p, np.maximum(g, 1.0)
