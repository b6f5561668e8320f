"""Capacity planning: how many replicas a traffic needs to meet an SLO, with and without speculation.

N replicas behind a router that spreads requests evenly each see λ/N. Random routing of a Poisson stream
gives each replica a Poisson stream; of a renewal stream with gap CV c, gaps of CV √(1 + (c² − 1)/N) (a
replica's gap is a geometric number of the stream's gaps). Routers that look at load (power of two
choices, the latency-aware router of docs/scaleout.md) do better than random, so the count here is an
upper bound for them. Each replica is then the single server the fitted model describes: its mean (and,
where the fit has them, p95/p99) E2E, TTFT and TPOT at λ/N for the traffic's length mix.

The answer is the smallest N whose every SLO metric holds, per candidate draft length k; plus what one
replica sustains within the SLO and the break-even load per replica above which speculation stops paying.
A count whose per-replica rate is past what the fitted runs reached (more than FIT_MARGIN above it) is
never the answer: the load term there is an extrapolation (a fit at 10-30 % of saturation once predicted
a fifth of the latency measured at 75 %), so the planner asks for more replicas, or a fit at that load.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.errors import SpecServeError
from specserve.latency.equations.formulas import BreakEven
from specserve.latency.equations.lengths import LengthClass
from specserve.latency.fitting.colocation import Colocation, scaled, split_cv
from specserve.latency.fitting.model import LatencyModel, Prediction
from specserve.latency.decisions.planning import AlphaSpec, break_even_for, candidate_ks
from specserve.latency.fitting.tails import METRICS, QUANTILES

STATS = ("mean",) + QUANTILES


@dataclass(frozen=True)
class Slo:
    """Bounds in seconds on each metric's `stat` (mean, p95 or p99); None: that metric is free."""
    e2e: float | None = None
    ttft: float | None = None
    tpot: float | None = None
    stat: str = "mean"

    def __post_init__(self) -> None:
        if self.stat not in STATS:
            raise SpecServeError(f"SLO statistic must be one of {', '.join(STATS)}, got {self.stat!r}")
        if not self.bounds:
            raise SpecServeError("give at least one SLO: --slo-e2e-ms, --slo-ttft-ms or --slo-tpot-ms")
        for metric, bound in self.bounds.items():
            if not bound > 0:
                raise SpecServeError(f"the {metric.upper()} SLO must be > 0, got {bound!r}")

    @property
    def bounds(self) -> dict[str, float]:
        return {m: getattr(self, m) for m in METRICS if getattr(self, m) is not None}

    def value(self, pred: Prediction, metric: str) -> float:
        if self.stat == "mean":
            return {"e2e": pred.e2e, "ttft": pred.ttft, "tpot": pred.tpot}[metric]
        q = pred.quantiles.get(metric, {}).get(self.stat)
        if q is None:
            raise SpecServeError(f"the fitted model has no {self.stat} of {metric.upper()} (its runs did not "
                                 f"report enough of them): plan on the mean instead")
        return q

    def met(self, pred: Prediction) -> bool:
        return all(self.value(pred, m) <= bound for m, bound in self.bounds.items())

    def describe(self) -> str:
        return ", ".join(f"{self.stat} {m.upper()} <= {b * 1e3:g} ms" for m, b in self.bounds.items())


@dataclass(frozen=True)
class Traffic:
    rate: float  # requests/s offered to the whole deployment
    classes: tuple[LengthClass, ...] | None = None  # None: the fitted runs' lengths
    cv: float | None = None  # arrival-gap CV of the whole stream; None: the fitted runs'
    source: str = ""


FIT_MARGIN = 1.1  # how far past the fitted runs' highest rate a per-replica rate may go and still be trusted


def beyond_fit(rate_per_replica: float, fitted_rate: float) -> bool:
    return rate_per_replica > FIT_MARGIN * fitted_rate


def per_replica(model: LatencyModel, traffic: Traffic, replicas: int, k: int, expected: float,
                rate: float | None = None, colocation: Colocation | None = None) -> Prediction:
    """What each replica sees at λ/N (or at `rate` per replica), for the traffic's length mix; with a
    co-location term, as one of `replicas` sharing the machine."""
    lam = traffic.rate / replicas if rate is None else rate
    cv = split_cv(model.arrival_cv if traffic.cv is None else traffic.cv, replicas)
    if colocation is not None:
        model = scaled(model, *colocation.factors(replicas))
    if traffic.classes:
        return model.predict_classes(lam, k, expected, traffic.classes, cv)[0]
    return model.predict(lam, k, expected, cv=cv)


def replicas_needed(model: LatencyModel, traffic: Traffic, slo: Slo, k: int, expected: float,
                    max_replicas: int, colocation: Colocation | None = None) -> tuple[int | None, Prediction | None]:
    """The fewest replicas meeting the SLO and what each then sees; (None, None) up to max_replicas."""
    if not slo.met(per_replica(model, traffic, 1, k, expected, rate=0.0, colocation=colocation)):
        return None, None  # a lone request already misses it: no number of replicas helps
    for n in range(1, max_replicas + 1):
        pred = per_replica(model, traffic, n, k, expected, colocation=colocation)
        if math.isfinite(pred.e2e) and slo.met(pred) and not beyond_fit(traffic.rate / n, model.fitted_rate(k)):
            return n, pred
    return None, None


def capacity_per_replica(model: LatencyModel, traffic: Traffic, slo: Slo, k: int, expected: float,
                         replicas: int, colocation: Colocation | None = None) -> float:
    """The most requests/s one of `replicas` replicas takes within the SLO (bisection: every metric grows
    with load); 0 when a lone request already misses it."""
    def ok(rate: float) -> bool:
        pred = per_replica(model, traffic, replicas, k, expected, rate=rate, colocation=colocation)
        return math.isfinite(pred.e2e) and slo.met(pred)

    if not ok(0.0):
        return 0.0
    s2 = colocation.factors(replicas)[1] if colocation is not None else 1.0
    lo, hi = 0.0, model.saturation_rate(k, expected) / s2
    if not math.isfinite(hi):
        return math.inf
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Option:
    """One configuration (k) and what it takes."""
    k: int
    expected: float
    replicas: int | None  # None: not within max_replicas
    at_replicas: Prediction | None  # what each replica then sees
    per_replica_capacity: float  # req/s one replica takes within the SLO (at that replica count's CV)
    break_even: BreakEven | None  # k > 0: where SD and plain decoding are equally fast, per replica


@dataclass
class CapacityPlan:
    traffic: Traffic
    slo: Slo
    options: list[Option]
    not_ranked: list[int]
    by_count: list[tuple[int, dict[int, Prediction]]] = field(default_factory=list)  # N -> {k: per replica}
    fitted_rates: dict[int, float] = field(default_factory=dict)  # k -> the fitted runs' highest rate
    colocation: Colocation | None = None  # None: replicas as independent copies of the fitted one

    def beyond_fit(self, replicas: int, k: int) -> bool:
        """Whether `replicas` replicas each take more than the fitted runs of k reached."""
        return beyond_fit(self.traffic.rate / replicas, self.fitted_rates.get(k, math.inf))

    def beyond_measured(self, replicas: int) -> bool:
        """Whether more replicas than the co-location term measured together share the machine."""
        return self.colocation is not None and self.colocation.beyond(replicas)

    @property
    def best(self) -> Option | None:
        """Fewest replicas; ties to the lower mean E2E, then the shorter draft."""
        feasible = [o for o in self.options if o.replicas is not None]
        return min(feasible, key=lambda o: (o.replicas, o.at_replicas.e2e, o.k)) if feasible else None

    @property
    def dense(self) -> Option | None:
        return next((o for o in self.options if o.k == 0), None)

    @property
    def best_speculative(self) -> Option | None:
        sd = [o for o in self.options if o.k > 0 and o.replicas is not None]
        return min(sd, key=lambda o: (o.replicas, o.at_replicas.e2e, o.k)) if sd else None


def plan_capacity(model: LatencyModel, traffic: Traffic, slo: Slo, ks: Sequence[int], alpha: AlphaSpec = None,
                  max_replicas: int = 64, colocation: Colocation | None = None) -> CapacityPlan:
    if not traffic.rate > 0 or not math.isfinite(traffic.rate):
        raise SpecServeError(f"the traffic's rate must be a positive number of requests/s, got {traffic.rate!r}")
    if max_replicas < 1:
        raise SpecServeError(f"--replicas (the most to consider) must be >= 1, got {max_replicas}")
    expected, not_ranked = candidate_ks(model, ks, alpha)
    options = []
    for k, e in expected.items():
        n, pred = replicas_needed(model, traffic, slo, k, e, max_replicas, colocation)
        capacity = capacity_per_replica(model, traffic, slo, k, e, n or max_replicas, colocation)
        options.append(Option(k, e, n, pred, capacity, break_even_for(model, k, e) if k > 0 else None))
    plan = CapacityPlan(traffic, slo, options, not_ranked, fitted_rates={k: model.fitted_rate(k) for k in expected},
                        colocation=colocation)
    # The table by replica count: every count up to one past the best answer, and each option's own answer.
    needed = {o.replicas for o in options if o.replicas is not None}
    best = plan.best.replicas if plan.best else min(max_replicas, 8)
    counts = sorted(n for n in set(range(1, best + 2)) | needed if n <= max_replicas)
    plan.by_count = [(n, {o.k: per_replica(model, traffic, n, o.k, o.expected, colocation=colocation)
                          for o in options}) for n in counts]
    return plan
