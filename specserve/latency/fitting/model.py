"""A fitted latency model: E2E, TTFT, TPOT means and their p95/p99 at any (λ, k, E, g, p)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import check_k
from specserve.latency.equations.arrival_regularity import EQUAL, Lifetimes, check_cv, company
from specserve.latency.fitting.e2e import E2EModel, latency_of, slot_wait_of
from specserve.latency.equations.formulas import Demands, check_rate
from specserve.latency.equations.lengths import LengthClass
from specserve.latency.equations.moe import MoeDemands, routed_tokens
from specserve.latency.equations.slots import slot_saturation
from specserve.latency.fitting.phases import PhaseModel, Point
from specserve.latency.fitting.tails import METRICS, QUANTILES, TailModel


def class_lifetimes(classes: tuple[LengthClass, ...]) -> Lifetimes:
    """Relative lifetimes of a mix of length classes (each lasting as long as its output)."""
    return Lifetimes.of([c.output_tokens for c in classes], [c.weight for c in classes])


@dataclass(frozen=True, slots=True)
class Configuration:
    """One measured server configuration (a bench label) and its own two-coefficient fit."""

    label: str
    k: int
    acceptance_length: float  # E measured (mean over the configuration's runs)
    alpha: float | None  # i.i.d. α with E(α, k) = E; None without SD
    alphas_by_position: tuple[float, ...] | None
    prompt_tokens: float
    output_tokens: float
    rate_range: tuple[float, float]  # achieved rates of the fitted runs
    n_runs: int
    fit: E2EModel | None  # None with fewer than 2 pre-saturation runs


@dataclass(frozen=True, slots=True)
class Prediction:
    rate: float
    k: int
    acceptance_length: float
    output_tokens: float
    prompt_tokens: float
    demands: Demands  # (C1, C2) of this configuration at this rate (MoE: at the coverage of its load)
    saturation_rate: float
    in_flight: float
    e2e: float
    ttft: float
    tpot: float
    quantiles: dict[str, dict[str, float]] = field(default_factory=dict)  # metric -> p95/p99
    unsupported: tuple[str, ...] = ()  # metrics whose coefficients for this configuration the fitted
    # data cannot separate (e.g. draft prefill vs target prefill with no plain-decoding runs)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    e2e: E2EModel
    ttft: PhaseModel
    tpot: PhaseModel
    tails: TailModel
    prompt_tokens: float  # reference lengths: means of the fitted runs
    output_tokens: float
    prefill_per_token: float | None  # TTFT seconds per prompt token; None if prompts never varied
    length_classes: tuple[LengthClass, ...]
    configurations: tuple[Configuration, ...]
    draft_catch_up: float | None = None  # D: seconds a request's first speculative step adds (the draft's
    # pass over the prompt), measured from per-request rows; None without SD runs or rows

    def phase_point(self, rate: float, k: int, expected: float, in_flight: float, g: float | None = None,
                    cv: float = 1.0) -> Point:
        """The point TTFT and TPOT are predicted at, TTFT's cycle from the TPOT model."""
        catch_up = self.draft_catch_up or 0.0
        g = self.output_tokens if g is None else g
        return Point(k, expected, in_flight, rate, g, cv, catch_up, self.tpot.cycle(k, in_flight, cv))

    def _split(self, k: int, expected: float, g: float, p: float) -> MoeDemands:
        split = self.e2e.split(k, expected, g)
        shift = (p - self.prompt_tokens) * (self.prefill_per_token or 0.0)
        # A longer prompt adds its prefill to the lone-request demand; never below zero.
        return replace(split, c1u=max(split.c1u + shift, 0.0))

    @property
    def arrival_cv(self) -> float:
        """The arrival CV predictions assume unless told: the fitted runs' (1 = Poisson)."""
        return self.e2e.arrival_cv

    def _cv(self, cv: float | None) -> float:
        return self.arrival_cv if cv is None else check_cv(cv)

    @property
    def lifetimes(self) -> Lifetimes:
        """The relative lifetimes predictions assume unless told: the fitted traffic's length classes."""
        return class_lifetimes(self.length_classes) if len(self.length_classes) > 1 else EQUAL

    def _mix(self, lifetimes: Lifetimes | None) -> Lifetimes:
        return self.lifetimes if lifetimes is None else lifetimes

    def latency(self, rate: float, k: int, expected: float, g: float | None = None,
                p: float | None = None, cv: float | None = None, lifetimes: Lifetimes | None = None) -> float:
        split = self._split(k, expected, g or self.output_tokens, self.prompt_tokens if p is None else p)
        return latency_of(split, rate, self.e2e.moe, k, self._cv(cv), self._mix(lifetimes), self.e2e.slots)

    def slot_wait(self, rate: float, k: int, expected: float, g: float | None = None, p: float | None = None,
                  cv: float | None = None, lifetimes: Lifetimes | None = None) -> float:
        """Mean seconds a request waits for a slot (0 for a server without a cap): part of its TTFT."""
        split = self._split(k, expected, g or self.output_tokens, self.prompt_tokens if p is None else p)
        return slot_wait_of(split, rate, self.e2e.moe, k, self._cv(cv), self._mix(lifetimes), self.e2e.slots)

    def demands(self, k: int, expected: float, g: float | None = None, p: float | None = None,
                rate: float = 0.0, cv: float | None = None, lifetimes: Lifetimes | None = None) -> Demands:
        """(C1, C2) in force at `rate`. Constant for dense-weight models; for MoE taken at the expert
        coverage of the load predicted there (at rate 0, a lone request's), so L = C1 + C2·company(λ·L) holds."""
        split = self._split(k, expected, g or self.output_tokens, self.prompt_tokens if p is None else p)
        moe = self.e2e.moe
        if moe is None:
            return split.full
        latency = latency_of(split, rate, moe, k, self._cv(cv), self._mix(lifetimes), self.e2e.slots)
        return split.full if math.isinf(latency) else split.at(moe.coverage(routed_tokens(rate * latency, k + 1)))

    def fitted_rate(self, k: int) -> float:
        """The highest rate the fitted runs of draft length k reached (of any k where none ran at k): past
        it a prediction extrapolates the load term."""
        same = [c.rate_range[1] for c in self.configurations if c.k == k]
        return max(same or [c.rate_range[1] for c in self.configurations] or [math.inf])

    def saturation_rate(self, k: int, expected: float, g: float | None = None, p: float | None = None) -> float:
        """1/C2, with C2 at full expert coverage for MoE (where a growing queue ends up); with a cap of c
        running requests, the rate that keeps every slot busy, which comes before 1/C2 (slots.py)."""
        full = self._split(k, expected, g or self.output_tokens, self.prompt_tokens if p is None else p).full
        if self.e2e.slots is None:
            return full.saturation_rate
        return slot_saturation(full.c1, full.c2, self.e2e.slots)

    def parts(self, metric: str, rate: float, k: int, expected: float, g: float | None = None,
              p: float | None = None, cv: float | None = None, tail: bool = False,
              lifetimes: Lifetimes | None = None) -> tuple[float, float]:
        """(lone-request part, load part) of a metric's mean; inf load at saturation. `tail`: the load
        part the tail model scales, which counts all B = λ·L in flight as company (Poisson's count) even
        where regular arrivals leave the average request less: the unlucky ones, whom a tail is about,
        meet them. Mixed lifetimes enter the E2E company; TTFT and TPOT take B from it."""
        cv, mix = self._cv(cv), self._mix(lifetimes)
        e2e = self.latency(rate, k, expected, g, p, cv, mix)
        if metric == "e2e":
            base = self.latency(0.0, k, expected, g, p, cv, mix)
            if tail and math.isfinite(e2e):
                b = rate * e2e
                c2 = self.demands(k, expected, g, p, rate, cv, mix).c2
                return base, e2e - base + c2 * (b - float(company(b, cv, mix)))
            return base, e2e - base
        if metric == "tpot":
            # TPOT is the time after the first token per later token, (E2E − TTFT)/(g − 1) for each request,
            # so the mean follows from the other two (exactly when g is one length): one model, three views.
            later = max((self.output_tokens if g is None else g) - 1.0, 1.0)
            (e_base, e_load), (t_base, t_load) = (self.parts(m, rate, k, expected, g, p, cv, tail, mix)
                                                  for m in ("e2e", "ttft"))
            return max(e_base - t_base, 0.0) / later, (e_load - t_load) / later
        if math.isinf(e2e):
            return self.ttft.parts(self.phase_point(0.0, k, expected, 0.0, g))[0], math.inf
        # A request waiting for a slot is in flight but not in the batch: the batch holds λ·(L − W).
        wait = self.slot_wait(rate, k, expected, g, p, cv, mix)
        base, load = self.ttft.parts(self.phase_point(rate, k, expected, rate * (e2e - wait), g,
                                                      1.0 if tail else cv))
        if p is not None:
            base = max(base + (p - self.prompt_tokens) * (self.prefill_per_token or 0.0), 0.0)
        return base, load + wait

    def predict(self, rate: float, k: int, expected: float, g: float | None = None,
                p: float | None = None, cv: float | None = None, lifetimes: Lifetimes | None = None) -> Prediction:
        """Means and tails at arrival rate λ with arrival-gap CV `cv` and the requests' relative
        `lifetimes` (defaults: the fitted runs' CV and length classes)."""
        check_rate(rate)
        check_k(k)
        cv, mix = self._cv(cv), self._mix(lifetimes)
        g = self.output_tokens if g is None else float(g)
        p = self.prompt_tokens if p is None else float(p)
        if not (1.0 <= expected <= k + 1):  # k = 0 leaves only E = 1
            raise SpecServeError(f"tokens per cycle E={expected:g} must be in [1, k+1] for k={k}")
        means, quantiles = {}, {}
        for metric in METRICS:
            base, load = self.parts(metric, rate, k, expected, g, p, cv, lifetimes=mix)
            means[metric] = base + load
            spread = self.parts(metric, rate, k, expected, g, p, cv, tail=True, lifetimes=mix)
            for q in QUANTILES:
                value = self.tails.predict(metric, q, *spread)
                if value is not None:
                    quantiles.setdefault(metric, {})[q] = value
        demands = self.demands(k, expected, g, p, rate, cv, mix)
        unsupported = tuple(m for m in METRICS if not self.estimable(m, k, expected, g))
        return Prediction(rate, k, expected, g, p, demands, self.saturation_rate(k, expected, g, p),
                          rate * means["e2e"], means["e2e"], means["ttft"], means["tpot"], quantiles,
                          unsupported)

    def estimable(self, metric: str, k: int, expected: float, g: float) -> bool:
        """Whether the fitted data identify this metric for (k, E, g); TTFT and TPOT also need the E2E
        model, which supplies their load B = λ·L."""
        ok = self.e2e.estimable(k, expected, g)
        if metric == "e2e":
            return ok
        # TTFT's load term rides on the cycle model's cycle; TPOT is E2E's time after TTFT
        return ok and self.tpot.estimable(k, expected) and self.ttft.estimable(k, expected)

    def predict_classes(self, rate: float, k: int, expected: float, classes: tuple[LengthClass, ...],
                        cv: float | None = None) -> tuple[Prediction, list[tuple[LengthClass, float, float]]]:
        """Mixture prediction and, per class, (class, mean E2E, mean TTFT) at the mixture's load."""
        total = sum(c.weight for c in classes)
        g = sum(c.weight * c.output_tokens for c in classes) / total
        p = sum(c.weight * c.prompt_tokens for c in classes) / total
        lifetimes = class_lifetimes(classes)
        mix = self.predict(rate, k, expected, g, p, cv, lifetimes)
        # every class is charged the mixture's (lifetime-weighted) company
        others = float(company(mix.in_flight, self._cv(cv), lifetimes)) if math.isfinite(mix.in_flight) else math.inf
        rows = []
        for c in classes:
            if math.isinf(mix.e2e):
                rows.append((c, math.inf, math.inf))
                continue
            # Expert coverage is set by the whole batch, so every class sees the mixture's φ.
            d = self._class_demands(mix, k, expected, c)
            shift = (c.prompt_tokens - p) * (self.prefill_per_token or 0.0)
            rows.append((c, d.c1 + others * d.c2, max(mix.ttft + shift, 0.0)))
        return mix, rows

    def _class_demands(self, mix: Prediction, k: int, expected: float, c: LengthClass) -> Demands:
        split = self._split(k, expected, c.output_tokens, c.prompt_tokens)
        if self.e2e.moe is None:
            return split.full
        return split.at(self.e2e.moe.coverage(routed_tokens(mix.in_flight, k + 1)))

    def configuration(self, k: int) -> Configuration | None:
        """The measured configuration with this k (the first, if several)."""
        return next((c for c in self.configurations if c.k == k), None)

    def typical_alpha(self) -> float | None:
        """Median i.i.d. α over the measured SD configurations: the default when none is given."""
        alphas = sorted(c.alpha for c in self.configurations if c.alpha)
        if not alphas:
            return None
        mid = len(alphas) // 2
        return alphas[mid] if len(alphas) % 2 else 0.5 * (alphas[mid - 1] + alphas[mid])
