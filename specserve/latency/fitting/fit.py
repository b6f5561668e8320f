"""Fit a `LatencyModel` from bench runs: saturation exclusion, per-configuration and pooled E2E fits,
TTFT/TPOT, tails, length classes, in-sample quality and cross-validation."""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.equations.acceptance import positional_acceptance, solve_alpha
from specserve.latency.equations.arrival_regularity import Lifetimes, company
from specserve.latency.fitting.crossval import cross_validate, groupings, observed_predicted, summarize
from specserve.latency.fitting.e2e import fit_e2e, lone_prefill
from specserve.latency.equations.lengths import LengthClass, length_classes, prefill_slope
from specserve.latency.fitting.model import Configuration, LatencyModel
from specserve.latency.equations.moe import MoeExperts
from specserve.latency.fitting.phases import Point, fit_phase
from specserve.latency.records.requests import RequestSample, load_request_samples
from specserve.latency.records.runs import BenchRun
from specserve.latency.records.saturation import SaturationRules, split_saturated
from specserve.latency.fitting.tails import TailModel, fit_tails


@dataclass(frozen=True, slots=True)
class FitOptions:
    moe: MoeExperts | None = None
    rules: SaturationRules = field(default_factory=SaturationRules)
    n_length_classes: int = 4
    cross_validate: bool = True
    prefill_prior: bool = True  # draw c2p towards a lone request's TTFT (e2e.py)
    draft_floor: bool = True  # a drafted token adds at least what a verify cycle does to load, c2d ≥ c2v (e2e.py)
    arrival_regularity: bool = True  # count the company the runs' stated arrival CV gives (arrivals.py);
    # False treats every run as Poisson, the λ·L of docs/design.md §2.1
    slots: int | None = None  # the server runs at most this many requests at once (slots.py); None: no cap


@dataclass(slots=True)
class FitReport:
    """A model plus everything that says how far to trust it (all JSON-ready except `model`)."""

    model: LatencyModel
    excluded: list[dict]
    notes: list[str]
    quality: dict  # target -> {"mape", "bias", "n"}, in-sample through the full model
    cross_validation: dict  # "rate" / "configuration" / "k" -> cross_validate() result
    sources: list[str]


def _configurations(runs: Sequence[BenchRun], moe: MoeExperts | None, notes: list[str],
                    fit_each: bool = True, slots: int | None = None) -> tuple[Configuration, ...]:
    out = []
    for label in sorted({r.label for r in runs}, key=lambda lab: next(r.k for r in runs if r.label == lab)):
        own = [r for r in runs if r.label == label]
        k, e = own[0].k, statistics.fmean(r.acceptance_length for r in own)
        fit = None  # cross-validation folds (fit_each false) predict from the pooled model only
        if fit_each and len(own) < 2:
            notes.append(f"{label}: only {len(own)} pre-saturation run, no per-configuration fit")
        elif fit_each:
            try:
                fit = fit_e2e(own, moe, pooled=False, slots=slots)
            except SpecServeError as err:
                notes.append(f"{label}: no per-configuration fit ({err})")
        counted = [r for r in own if r.accepted_per_position]
        width = max((len(r.accepted_per_position) for r in counted), default=0)
        positional = positional_acceptance(
            sum(r.num_drafts for r in counted),
            [sum(r.accepted_per_position[i] for r in counted if i < len(r.accepted_per_position))
             for i in range(width)])
        rates = [r.achieved_rate for r in own]
        out.append(Configuration(
            label, k, e, solve_alpha(e, k) if k > 0 else None,
            tuple(positional[:k]) if positional and k > 0 else None,
            statistics.fmean(r.prompt_tokens for r in own), statistics.fmean(r.output_tokens for r in own),
            (min(rates), max(rates)), len(own), fit))
    return tuple(out)


def fit_model(runs: Sequence[BenchRun], moe: MoeExperts | None = None,
              samples: dict[str, RequestSample] | None = None, n_length_classes: int = 4,
              notes: list[str] | None = None, per_configuration: bool = True,
              prefill_prior: bool = True, draft_floor: bool = True, slots: int | None = None) -> LatencyModel:
    """Fit every component on the given (pre-saturation) runs; `per_configuration` adds each
    configuration's own (C1, C2) fit, which predictions do not use. With `slots`, E2E comes first: the
    wait for a slot it predicts is taken off each run's TTFT and its queue off the batch the phases see."""
    runs, samples, notes = list(runs), samples or {}, notes if notes is not None else []
    used = [samples[r.source] for r in runs if r.source in samples]
    slope = prefill_slope([(s.prompt_tokens, s.ttft) for s in used])
    classes: tuple[LengthClass, ...] = ()
    if used:
        classes = length_classes(np.concatenate([s.prompt_tokens for s in used]),
                                 np.concatenate([s.output_tokens for s in used]), n_length_classes)
    catch_up = draft_catch_up(runs, samples)
    e2e = fit_e2e(runs, moe, prefill_prior=prefill_prior, draft_floor=draft_floor, slots=slots)
    waits = np.array([e2e.slot_wait(r.achieved_rate, r.k, r.acceptance_length, r.output_tokens, r.cv, r.lifetimes)
                      for r in runs])
    points = [Point(r.k, r.acceptance_length, max(r.in_flight - r.achieved_rate * w, 0.0), r.achieved_rate,
                    r.output_tokens, r.cv, catch_up or 0.0) for r, w in zip(runs, waits)]
    tpot = fit_phase("tpot", runs, points)
    points = [replace(p, cycle=tpot.cycle(p.k, p.in_flight, p.cv)) for p in points]
    model = LatencyModel(
        e2e=e2e, ttft=fit_phase("ttft", runs, points, waits), tpot=tpot,
        tails=TailModel({}), prompt_tokens=statistics.fmean(r.prompt_tokens for r in runs),
        output_tokens=statistics.fmean(r.output_tokens for r in runs), prefill_per_token=slope,
        length_classes=classes, configurations=_configurations(runs, moe, notes, per_configuration, slots),
        draft_catch_up=catch_up)

    def parts(metric: str, run: BenchRun) -> tuple[float, float]:
        return model.parts(metric, run.achieved_rate, run.k, run.acceptance_length, run.output_tokens,
                           run.prompt_tokens, run.cv, tail=True, lifetimes=run.lifetimes)

    return replace(model, tails=fit_tails(runs, parts))


def draft_catch_up(runs: Sequence[BenchRun], samples: dict[str, RequestSample]) -> float | None:
    """D: the mean over the speculative runs' requests of their first inter-token gap less their later
    ones'. A request's first speculative step runs the draft over its whole prompt, whose KV the draft
    does not share with the target's prefix cache. None without speculative runs that have such rows."""
    gaps = [s.first_gap_excess for r in runs if r.k > 0 and (s := samples.get(r.source)) is not None
            and s.first_gap_excess is not None]
    gaps = np.concatenate(gaps) if gaps else np.array([])
    gaps = gaps[np.isfinite(gaps)]
    return max(float(gaps.mean()), 0.0) if gaps.size else None


def fit_runs(runs: Sequence[BenchRun], options: FitOptions | None = None,
             sources: Sequence[str] = (), unusable: Sequence[dict] = ()) -> FitReport:
    """Exclude saturated runs, fit, and measure in-sample and cross-validated errors. `unusable`: records
    `load_runs` could not turn into runs, listed with the exclusions."""
    options = options or FitOptions()
    if not options.arrival_regularity:
        runs = [replace(r, arrival_cv=None) for r in runs]
    kept, exclusions = split_saturated(runs, options.rules)
    excluded = list(unusable) + [{"label": x.run.label, "k": x.run.k, "offered_rate": x.run.offered_rate,
                 "achieved_rate": x.run.achieved_rate, "e2e_mean_s": x.run.e2e.mean, "source": x.run.source,
                 "reasons": list(x.reasons)}
                for x in exclusions]
    if len(kept) < 2:
        why = "; ".join(f"{x.run.source}: {', '.join(x.reasons)}" for x in exclusions[:3])
        raise SpecServeError(f"only {len(kept)} of {len(runs)} runs are below saturation; need at least 2 "
                             f"(excluded: {why}{' ...' if len(exclusions) > 3 else ''})")
    samples, notes = load_request_samples(kept)
    # Each run's spread of lifetimes (from its output lengths) sets the company its requests keep.
    kept = [replace(r, lifetimes=Lifetimes.of(samples[r.source].output_tokens)) if r.source in samples else r
            for r in kept]
    model = fit_model(kept, options.moe, samples, options.n_length_classes, notes,
                      prefill_prior=options.prefill_prior, draft_floor=options.draft_floor, slots=options.slots)
    if options.prefill_prior and options.moe is None:
        notes.append(f"c2p drawn towards a lone request's TTFT ({lone_prefill(kept):.3g} s, prefill prior; "
                     "--no-prefill-prior fits without it)")
    coefficients = model.e2e.coefficients
    if (options.draft_floor and options.moe is None and "c2d" not in coefficients.not_identifiable
            and 0 < coefficients["c2v"] and coefficients["c2d"] <= coefficients["c2v"] * (1 + 1e-6)):
        notes.append("c2d held at its floor c2v (a drafted token adds at least the load a verify cycle adds; "
                     "--no-draft-floor fits without it)")
    notes.append(_arrival_note(kept, options.arrival_regularity, model.arrival_cv))
    measured = [(samples[r.source].company, r) for r in kept
                if r.source in samples and samples[r.source].company is not None]
    if measured:
        notes.append(_company_note(measured))
    if model.prefill_per_token is None:
        notes.append("prompt lengths did not vary within runs: prefill cost per token is unknown, "
                     "so predictions at other prompt lengths keep the fitted prefill")
    pairs = [observed_predicted(model, r) for r in kept]
    crossval = {}
    if options.cross_validate:
        def refit(train: list[BenchRun]) -> LatencyModel:
            return fit_model(train, options.moe, samples, options.n_length_classes, [], per_configuration=False,
                             prefill_prior=options.prefill_prior, draft_floor=options.draft_floor,
                             slots=options.slots)
        noise = {source: std for source, s in samples.items() if (std := s.e2e_noise_std()) is not None}
        for by in groupings(kept):
            crossval[by] = cross_validate(kept, by, refit, noise)
    return FitReport(model, excluded, notes, summarize(pairs), crossval, list(sources))


def _arrival_note(runs: Sequence[BenchRun], regularity: bool, assumed: float) -> str:
    cvs = sorted({r.cv for r in runs})
    if not regularity:
        return "arrivals taken as Poisson (--assume-poisson): load is the λ·L of docs/design.md §2.1"
    if cvs == [1.0]:
        return "arrivals Poisson (or not stated): load is the λ·L of docs/design.md §2.1"
    stated = ", ".join(f"{c:g}" for c in cvs)
    return (f"arrival-gap CV {stated}: load is the company such arrivals give a request (arrivals.py; "
            f"--assume-poisson fits the λ·L of docs/design.md §2.1); predictions assume CV {assumed:g} unless "
            "--arrival-cv says otherwise")


def _company_note(measured: Sequence[tuple[float, BenchRun]]) -> str:
    """How well the load terms' company matches what the per-request rows measured."""
    assumed = [abs(float(company(r.in_flight, r.cv, r.lifetimes)) - c) for c, r in measured]
    poisson = [abs(r.in_flight - c) for c, r in measured]
    return (f"company over the requests' lifetimes, measured from the per-request rows of {len(measured)} runs: "
            f"mean |measured - modelled| {statistics.fmean(assumed):.2f} requests with the runs' arrival CV "
            "and lengths, "
            f"{statistics.fmean(poisson):.2f} with Poisson's rate x L")
