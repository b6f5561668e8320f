"""Prediction errors: in-sample, leave-one-rate-out (LORO), leave-one-configuration-out (LOCO) and
leave-one-k-out.

A held-out point is predicted at its achieved rate with its own k, measured E, lengths (their mean and
spread) and arrival CV —
what a user knows before running it. Metrics the training data cannot speak for at a point's configuration
(see `RowSpace`) are left out with a note rather than predicted with coefficients never identified.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

from specserve.errors import SpecServeError
from specserve.latency.fitting.model import LatencyModel
from specserve.latency.records.runs import BenchRun
from specserve.latency.fitting.tails import METRICS, QUANTILES

TARGETS = METRICS + tuple(f"{m}_{q}" for m in METRICS for q in QUANTILES)


def observed_predicted(model: LatencyModel, run: BenchRun) -> dict[str, tuple[float, float]]:
    """{target: (observed, predicted)} for one run, leaving out metrics the model cannot speak for."""
    pred = model.predict(run.achieved_rate, run.k, run.acceptance_length, run.output_tokens,
                         run.prompt_tokens, run.cv, run.lifetimes)
    out = {}
    for metric in METRICS:
        if metric in pred.unsupported:
            continue
        stats = getattr(run, metric)
        out[metric] = (stats.mean, getattr(pred, metric))
        for q in QUANTILES:
            value = pred.quantiles.get(metric, {}).get(q)
            if stats.quantile(q) is not None and value is not None:
                out[f"{metric}_{q}"] = (stats.quantile(q), value)
    return out


def summarize(pairs: Sequence[dict[str, tuple[float, float]]]) -> dict[str, dict[str, float]]:
    """{target: {"mape": percent, "bias": percent, "n": count}}; bias is the mean signed error (negative:
    predicted too low), which tells a systematic miss (|bias| near the MAPE) from scatter around the
    prediction (bias near 0). A saturated prediction counts as an infinite error."""
    errors: dict[str, list[float]] = defaultdict(list)
    for pair in pairs:
        for target, (obs, pred) in pair.items():
            errors[target].append(math.inf if math.isinf(pred) else (pred - obs) / obs * 100.0)
    return {t: {"mape": sum(map(abs, errors[t])) / len(errors[t]), "bias": sum(errors[t]) / len(errors[t]),
                "n": len(errors[t])} for t in TARGETS if errors[t]}


def standard_error(runs: Sequence[BenchRun], noise_std: Mapping[str, float] | None = None,
                   metric: str = "e2e") -> float | None:
    """Mean over runs of the standard error of the run's measured mean `metric`, in percent of it
    (within-run spread / sqrt(requests)): how far a perfect model's prediction would miss from sampling
    noise alone (a floor: drift of the machine between runs comes on top). For E2E the spread is
    `noise_std[run.source]` where given (the part the requests' own lengths do not explain:
    RequestSample.e2e_noise_std), else the run's std. None when no run reports its spread."""
    noise_std = noise_std if metric == "e2e" and noise_std else {}
    errors = [noise_std.get(r.source, stats.std) / math.sqrt(r.num_completed) / stats.mean * 100.0
              for r in runs if (stats := getattr(r, metric)).std is not None and r.num_completed > 1]
    return sum(errors) / len(errors) if errors else None


def noise(runs: Sequence[BenchRun], noise_std: Mapping[str, float] | None = None) -> dict[str, float | None]:
    """{metric: standard_error} for the mean metrics."""
    return {metric: standard_error(runs, noise_std, metric) for metric in METRICS}


def rate_ranks(runs: Sequence[BenchRun]) -> list[int]:
    """Each run's rank (1 = lowest offered rate) within its configuration in its results file. Files
    are repeats of one sweep design, so (label, rank) names a design point measured once per file."""
    rank = [0] * len(runs)
    for key in {(r.label, r.results_file) for r in runs}:
        members = sorted((i for i, r in enumerate(runs) if (r.label, r.results_file) == key),
                         key=lambda i: (runs[i].offered_rate or runs[i].achieved_rate, runs[i].achieved_rate))
        for n, i in enumerate(members, start=1):
            rank[i] = n
    return rank


def holdout_groups(runs: Sequence[BenchRun], by: str) -> list[tuple[str, list[int]]]:
    """[(description, indices)] for `by` = "rate", "configuration" (a label: one (α, k)) or "k" (every
    label with that k, e.g. one k swept at two traffic mixes). Rates are grouped by rank within each
    configuration and results file, so "the 3rd rate" is held out of every configuration, and of every
    repeat of the sweep, at once, even when configurations were swept at different rates."""
    if by == "configuration":
        labels = sorted({r.label for r in runs}, key=lambda lab: (next(r.k for r in runs if r.label == lab), lab))
        return [(f"{lab} (k={next(r.k for r in runs if r.label == lab)})",
                 [i for i, r in enumerate(runs) if r.label == lab]) for lab in labels]
    if by == "k":
        return [(f"k={k}", [i for i, r in enumerate(runs) if r.k == k]) for k in sorted({r.k for r in runs})]
    if by != "rate":
        raise SpecServeError(f"unknown hold-out grouping {by!r} (use 'rate', 'configuration' or 'k')")
    rank = rate_ranks(runs)
    groups = []
    for n in sorted(set(rank)):
        idx = [i for i in range(len(runs)) if rank[i] == n]
        lo, hi = min(runs[i].achieved_rate for i in idx), max(runs[i].achieved_rate for i in idx)
        span = f"{lo:.3g}" if hi <= 1.02 * lo else f"{lo:.3g}-{hi:.3g}"
        groups.append((f"rate #{n} ({span} req/s)", idx))
    return groups


def repeats(points: Mapping[tuple, list[tuple[float, float]]]) -> dict | None:
    """Mean E2E error at design points measured more than once (one sweep design, several results
    files), each point's repeats averaged: {"mape", "noise", "points"}. "noise" is what a perfect model
    would still miss by from the repeats' own scatter, E|mean of n − truth| = σ/√n·√(2/π) with σ
    estimated as s/c4(n) (s is biased low for few repeats), in percent: unlike the within-run SE it
    counts the drift of the machine between runs and the correlation of requests queued together. None
    when no point was repeated."""
    errors, noise = [], []
    for pairs in points.values():
        if len(pairs) < 2:
            continue
        observed, predicted = [o for o, _ in pairs], [p for _, p in pairs]
        mean = statistics.fmean(observed)
        errors.append(abs(statistics.fmean(predicted) - mean) / mean * 100.0)
        n = len(pairs)
        c4 = math.sqrt(2 / (n - 1)) * math.exp(math.lgamma(n / 2) - math.lgamma((n - 1) / 2))
        noise.append(statistics.stdev(observed) / c4 / math.sqrt(n) * math.sqrt(2 / math.pi) / mean * 100.0)
    if not errors:
        return None
    return {"mape": statistics.fmean(errors), "noise": statistics.fmean(noise), "points": len(errors)}


def groupings(runs: Sequence[BenchRun]) -> list[str]:
    """The hold-out groupings worth running: by rate; by configuration when there are several; by k too
    when some k has several configurations (otherwise it is the same as by configuration)."""
    labels, ks = {r.label for r in runs}, {r.k for r in runs}
    return ["rate"] + (["configuration"] if len(labels) > 1 else []) + (["k"] if 1 < len(ks) < len(labels) else [])


def cross_validate(runs: Sequence[BenchRun], by: str, fit: Callable[[list[BenchRun]], LatencyModel],
                   noise_std: Mapping[str, float] | None = None) -> dict:
    """Refit without each group, predict the group. Returns per-group and overall MAPE by target, the
    groups' measurement noise (`standard_error` with `noise_std`) and, where the sweep was repeated, the
    error at the repeats' averages beside their own scatter (`repeats`)."""
    groups, all_pairs = [], []
    rank = rate_ranks(runs)
    all_points: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    for description, idx in holdout_groups(runs, by):
        held = set(idx)
        train = [r for i, r in enumerate(runs) if i not in held]
        row: dict = {"held_out": description, "n": len(idx), "mape": {},
                     "se": noise([runs[i] for i in idx], noise_std)}
        try:
            model = fit(train)
        except SpecServeError as e:
            row["note"] = f"training fit failed: {e}"
            groups.append(row)
            continue
        pairs = [observed_predicted(model, runs[i]) for i in idx]
        row["mape"] = summarize(pairs)
        missing = [m for m in METRICS if m not in row["mape"]]
        if missing:
            row["note"] = (f"{', '.join(m.upper() for m in missing)} not predicted: the other "
                           "configurations cannot identify the coefficients this one needs")
        points: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
        for i, pair in zip(idx, pairs):
            if "e2e" in pair:
                points[(runs[i].label, rank[i])].append(pair["e2e"])
                all_points[(runs[i].label, rank[i])].append(pair["e2e"])
        row["repeats"] = repeats(points)
        all_pairs += pairs
        groups.append(row)
    return {"by": by, "groups": groups, "overall": summarize(all_pairs), "se": noise(runs, noise_std),
            "repeats": repeats(all_points)}
