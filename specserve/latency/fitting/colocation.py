"""Co-location: what running N replicas on one machine costs each of them.

The fitted model describes one replica measured alone. N replicas on one machine share its cores, memory
bandwidth, Ray and the HTTP front, so each is slower than that lone replica, and the planner's N
independent copies of the model promise too much. The term: for each replica count n measured, factors on
the model's two demands, each replica of n being the fitted model with

    C1 -> s1(n)·C1   (a lone request's time: slower cores, more hops)
    C2 -> s2(n)·C2   (what each request in flight adds: the shared step, memory bandwidth)

and TTFT's and TPOT's load-independent parts scaled by s1, their load parts by s2. (s1, s2) are fitted
from runs of the deployment at n replicas: the relative residuals of the mean E2E the planner predicts for
each run (its rate split n ways, the split arrival CV, its length mix) against the measured mean, the
least-squares way. Runs at one rate alone cannot tell C1 from C2: they give one shared factor s1 = s2.

s(1) is the deployment measured against the fit at one replica: the fit's runs and the deployment's are
taken at different times (and through whatever hops differ), so it is not 1 in general; s(n)/s(1) is what
co-location proper costs. Factors hold for the machine, model and thread count they were measured with;
past the largest n measured the planner uses that count's factors and marks the count (more replicas
contend more: the answer is optimistic there).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.lengths import LengthClass
from specserve.latency.fitting.model import LatencyModel


def split_cv(cv: float, replicas: int) -> float:
    """Gap CV each of `replicas` sees when a renewal stream of gap CV `cv` is split at random."""
    return math.sqrt(max(1.0 + (cv * cv - 1.0) / replicas, 0.0))


@dataclass(frozen=True, slots=True)
class Slowdown:
    replicas: int
    c1: float  # s1: factor on C1 (and TTFT's, TPOT's lone-request parts)
    c2: float  # s2: factor on C2 (and their load parts)
    n_runs: int
    mape: float  # percent, mean |predicted - measured| / measured over the runs it was fitted on


@dataclass(frozen=True, slots=True)
class Colocation:
    slowdowns: tuple[Slowdown, ...]  # one per replica count measured, fewest first

    def __post_init__(self) -> None:
        if not self.slowdowns:
            raise SpecServeError("a co-location term needs at least one measured replica count")
        for s in self.slowdowns:
            if s.replicas < 1 or not (s.c1 > 0 and s.c2 > 0):
                raise SpecServeError(f"co-location factors must be > 0 for a count >= 1, got {s}")

    @property
    def measured(self) -> int:
        """The most replicas measured together."""
        return max(s.replicas for s in self.slowdowns)

    def beyond(self, replicas: int) -> bool:
        return replicas > self.measured

    def factors(self, replicas: int) -> tuple[float, float]:
        """(s1, s2) at `replicas`: the measured count's, else the largest measured count below it."""
        below = [s for s in self.slowdowns if s.replicas <= replicas] or [min(self.slowdowns, key=lambda s: s.replicas)]
        s = max(below, key=lambda s: s.replicas)
        return s.c1, s.c2

    def to_dict(self) -> dict:
        return {"slowdowns": [{"replicas": s.replicas, "c1": s.c1, "c2": s.c2, "n_runs": s.n_runs,
                               "mape_percent": s.mape} for s in self.slowdowns]}

    @classmethod
    def from_dict(cls, d: dict) -> "Colocation":
        return cls(tuple(Slowdown(int(s["replicas"]), float(s["c1"]), float(s["c2"]), int(s["n_runs"]),
                                  math.nan if s.get("mape_percent") is None else float(s["mape_percent"]))
                         for s in sorted(d["slowdowns"], key=lambda s: s["replicas"])))


@dataclass(frozen=True, slots=True)
class _ScaledPhase:
    """A TTFT model whose lone-request part is scaled by s1 and load part by s2, and a TPOT model whose
    cycle is (TTFT reads it)."""
    phase: object
    s1: float
    s2: float

    def parts(self, *args, **kwargs) -> tuple[float, float]:
        base, load = self.phase.parts(*args, **kwargs)
        return base * self.s1, load * self.s2

    def cycle(self, k: int, in_flight: float, cv: float = 1.0) -> float:
        lone = self.phase.cycle(k, 0.0, cv)
        return lone * self.s1 + (self.phase.cycle(k, in_flight, cv) - lone) * self.s2

    def estimable(self, *args, **kwargs) -> bool:
        return self.phase.estimable(*args, **kwargs)

    @property
    def coefficients(self):
        return self.phase.coefficients


def scaled(model: LatencyModel, s1: float, s2: float) -> LatencyModel:
    """The model of one replica whose C1 is s1 times the fitted one's and C2 s2 times."""
    if s1 == 1.0 and s2 == 1.0:
        return model
    c = model.e2e.coefficients
    values = {name: v * (s1 if name.lower().startswith("c1") else s2) for name, v in c.values.items()}
    return replace(model, e2e=replace(model.e2e, coefficients=replace(c, values=values)),
                   ttft=_ScaledPhase(model.ttft, s1, s2), tpot=_ScaledPhase(model.tpot, s1, s2),
                   prefill_per_token=None if model.prefill_per_token is None else model.prefill_per_token * s1)


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured run of the deployment: its traffic as the planner sees it, and its mean E2E."""
    replicas: int
    rate: float  # requests/s offered to the whole deployment
    cv: float  # arrival-gap CV of the whole stream
    classes: tuple[LengthClass, ...]
    e2e: float  # measured mean E2E, s
    source: str = ""


def predicted_e2e(model: LatencyModel, obs: Observation, s1: float = 1.0, s2: float = 1.0) -> float:
    """The planner's mean E2E for the run: one of its replicas at rate/n, the split CV, its length mix."""
    m = scaled(model, s1, s2)
    return m.predict_classes(obs.rate / obs.replicas, 0, 1.0, obs.classes, split_cv(obs.cv, obs.replicas))[0].e2e


def _fit_count(model: LatencyModel, runs: Sequence[Observation]) -> Slowdown:
    from scipy.optimize import least_squares

    measured = np.array([o.e2e for o in runs])
    shared = len({round(o.rate, 6) for o in runs}) < 2  # one rate: C1 and C2 are not separable

    def factors(x: np.ndarray) -> tuple[float, float]:
        s1, s2 = np.exp(x[0]), np.exp(x[0] if shared else x[1])
        return float(s1), float(s2)

    def residuals(x: np.ndarray) -> np.ndarray:
        s1, s2 = factors(x)
        pred = np.array([predicted_e2e(model, o, s1, s2) for o in runs])
        # Saturated at these factors: a penalty growing with s2, so the search turns back.
        return np.where(np.isfinite(pred), (np.where(np.isfinite(pred), pred, 0.0) - measured) / measured,
                        1e3 * (1.0 + np.exp(x[-1])))

    res = least_squares(residuals, np.zeros(1 if shared else 2), method="trf", x_scale=1.0)
    s1, s2 = factors(res.x)
    errors = np.abs(residuals(res.x))
    return Slowdown(runs[0].replicas, s1, s2, len(runs), float(100 * errors.mean()))


def fit_colocation(model: LatencyModel, observations: Sequence[Observation]) -> Colocation:
    """(s1, s2) per replica count from pre-saturation runs of plain decoding (k = 0)."""
    by_count: dict[int, list[Observation]] = {}
    for o in observations:
        by_count.setdefault(o.replicas, []).append(o)
    if not by_count:
        raise SpecServeError("no runs to fit the co-location term on")
    return Colocation(tuple(_fit_count(model, by_count[n]) for n in sorted(by_count)))
