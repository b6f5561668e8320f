"""Which runs are past saturation, or never in a steady state, and must not be fitted (docs/design.md §2.1: fit only
pre-saturation points).

A saturated run has no steady state: its mean latency depends on how long the run lasted, not on the rate,
so a single such point can drag C2 anywhere. Every exclusion carries its reasons so the user can check them.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from specserve.errors import SpecServeError
from specserve.latency.records.runs import BenchRun


@dataclass(frozen=True, slots=True)
class SaturationRules:
    """Thresholds; defaults are loose enough for Poisson noise in runs of a few hundred requests."""

    rate_tolerance: float = 0.10  # achieved may fall this fraction short of the arrival (or offered) rate
    # The trend of a stable queue over a few hundred requests is noisy: near half load its growth over the
    # run is often ±40% of the mean in flight, because the count drifts slowly. Only growth beyond the mean
    # itself (the count at least doubling along the trend) is taken as a queue that does not drain ...
    growth_tolerance: float = 1.0
    min_growth: float = 2.0  # ... and at least this many requests (small queues fluctuate by a few)
    # Little's law (B = λ·L) holds over any window of a steady state. When a run measured after a warm-up
    # (--discard-first) is past saturation, the in-flight count can look flat at its high level while the
    # measured requests' latencies and the achieved rate (departures bunch as the backlog drains) say
    # otherwise: λ·L then exceeds the measured mean in flight several-fold. Steady runs of a few dozen
    # requests on our server agreed within 20 %.
    littles_law_tolerance: float = 0.25
    max_failed_fraction: float = 0.01

    def __post_init__(self) -> None:
        for name in ("rate_tolerance", "growth_tolerance", "min_growth", "max_failed_fraction",
                     "littles_law_tolerance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise SpecServeError(f"saturation rule {name} must be >= 0, got {value!r}")
        if self.rate_tolerance >= 1:
            raise SpecServeError("saturation rule rate_tolerance must be < 1")


@dataclass(frozen=True, slots=True)
class Exclusion:
    run: BenchRun
    reasons: tuple[str, ...]


def rate_floor(run: BenchRun, rules: SaturationRules) -> tuple[float, str] | None:
    """The achieved rate below which a run counts as saturated, and what it is measured against.

    Below saturation departures follow arrivals, so the achieved rate matches the realised arrival rate
    (specserve bench writes it). Without it, compare with the offered rate, widening the tolerance by the
    Poisson noise of n arrivals (3/√n) so that an unlucky draw is not mistaken for saturation.

    The achieved rate divides completions by the span from first to last *completion*, which exceeds the
    span of arrivals by up to the longest latency (a long request arriving late finishes last). With
    mixed lengths in a short run that alone reads as a shortfall of several percent, so the floor is
    scaled by span/(span + p99 latency).
    """
    span = run.duration_s
    drain = span / (span + run.e2e.p99) if span > 0 and run.e2e.p99 is not None else 1.0
    if run.arrival_rate is not None and run.arrival_rate > 0:
        return run.arrival_rate * (1 - rules.rate_tolerance) * drain, "arrived"
    if run.offered_rate is None or run.offered_rate <= 0:
        return None
    noise = 3 / math.sqrt(run.num_completed) if run.num_completed > 0 else 0.0
    return run.offered_rate * (1 - min(max(rules.rate_tolerance, noise), 0.9)) * drain, "offered"


def saturation_reasons(run: BenchRun, rules: SaturationRules) -> list[str]:
    reasons = []
    if run.arrival_process == "burst":
        reasons.append("burst arrivals (all at once) have no steady state")
    floor = rate_floor(run, rules)
    if floor is not None and run.achieved_rate < floor[0]:
        basis = (f"requests arrived at {run.arrival_rate:.3g} req/s" if floor[1] == "arrived"
                 else f"{run.offered_rate:.3g} req/s offered")
        reasons.append(f"achieved {run.achieved_rate:.3g} req/s while {basis}")
    if run.in_flight_slope is not None and run.duration_s > 0:
        growth = run.in_flight_slope * run.duration_s
        level = run.mean_in_flight if run.mean_in_flight is not None else run.in_flight
        if growth > max(rules.growth_tolerance * level, rules.min_growth):
            reasons.append(f"in-flight requests grew by {growth:.3g} over the run (mean {level:.3g})")
    if run.mean_in_flight and run.e2e.mean is not None:
        implied = run.achieved_rate * run.e2e.mean
        low, high = sorted((implied, run.mean_in_flight))
        if high > (1 + rules.littles_law_tolerance) * low and high - low > rules.min_growth:
            reasons.append(f"Little's law does not hold: achieved rate x mean E2E = {implied:.3g} in flight, "
                           f"measured {run.mean_in_flight:.3g} (no steady state)")
    if run.preemptions:
        reasons.append(f"server reported {run.preemptions} preemptions")
    if run.num_requests and run.num_failed > rules.max_failed_fraction * run.num_requests:
        reasons.append(f"{run.num_failed} of {run.num_requests} requests failed")
    return reasons


def split_saturated(runs: Iterable[BenchRun], rules: SaturationRules | None = None,
                    ) -> tuple[list[BenchRun], list[Exclusion]]:
    """(pre-saturation runs, excluded runs with reasons)."""
    rules = rules or SaturationRules()
    kept, excluded = [], []
    for run in runs:
        reasons = saturation_reasons(run, rules)
        if reasons:
            excluded.append(Exclusion(run, tuple(reasons)))
        else:
            kept.append(run)
    return kept, excluded
