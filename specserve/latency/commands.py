"""Handlers of `specserve latency ...` (see cli.py for the arguments). Each returns an exit code."""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path

from specserve.errors import SpecServeError
from specserve.latency.fitting import model_file
from specserve.latency.equations.arrival_regularity import check_cv
from specserve.latency.equations.rate_drift import fit_rate_drift, over_drift
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.equations.lengths import length_classes, read_lengths
from specserve.latency.equations.moe import MoeExperts
from specserve.latency.equations.slots import check_slots
from specserve.latency.decisions.planning import (acceptance_for, break_even_for, candidate_ks, coefficient_draws,
                                       max_rate_within, measured_ks, outside_measured, plan)
from specserve.latency.decisions.report import coefficient_band, explain as explain_text, percent, seconds
from specserve.latency.records.runs import load_runs
from specserve.latency.records.saturation import SaturationRules


def _numbers(values: list[str] | str, kind=float) -> list:
    text = ",".join(values) if isinstance(values, list) else values
    try:
        return [kind(v) for v in text.replace(" ", ",").split(",") if v]
    except ValueError:
        raise SpecServeError(f"expected a list of numbers, got {text!r}") from None


def _pairs(items: list[str], kind, flag: str) -> dict:
    out = {}
    for item in items:
        label, sep, value = item.partition("=")
        try:
            if not sep or not label:
                raise ValueError
            out[label] = kind(value)
        except ValueError:
            raise SpecServeError(f"{flag} expects LABEL=VALUE, got {item!r}") from None
    return out


def _runs(args: argparse.Namespace, unusable: list | None = None):
    return load_runs(args.results, _pairs(args.k, int, "--k"), _pairs(args.alpha, float, "--alpha"), unusable)


def _options(args: argparse.Namespace, cross_validate: bool) -> FitOptions:
    moe = None
    if args.moe:
        active, sep, experts = args.moe.partition("/")
        if not (sep and active.isdigit() and experts.isdigit()):
            raise SpecServeError(f"--moe expects ACTIVE/EXPERTS like 8/128, got {args.moe!r}")
        moe = MoeExperts(int(active), int(experts))
    rules = SaturationRules(rate_tolerance=args.rate_tolerance, growth_tolerance=args.growth_tolerance)
    return FitOptions(moe, rules, args.length_classes, cross_validate, not args.no_prefill_prior,
                      not args.no_draft_floor, not args.assume_poisson, check_slots(args.slots))


def _model(args: argparse.Namespace):
    """The saved model, predicting for --arrival-cv traffic where given."""
    m = model_file.load(args.model).model
    if args.arrival_cv is None:
        return m
    return replace(m, e2e=replace(m.e2e, arrival_cv=check_cv(args.arrival_cv)))


def fit(args: argparse.Namespace) -> int:
    unusable: list[dict] = []
    runs = _runs(args, unusable)
    report = fit_runs(runs, _options(args, not args.no_cross_validation), list(args.results), unusable)
    model_file.save(report, args.output)
    m = report.model
    print(f"fitted {sum(c.n_runs for c in m.configurations)} runs of {len(m.configurations)} configurations; "
          f"{len(report.excluded)} excluded (saturated or not steady) -> {args.output}")
    for x in report.excluded:
        print(f"  excluded {x['label']} @ {x['achieved_rate']:.3g} req/s: {'; '.join(x['reasons'])}")
    c = m.e2e.coefficients
    print("pooled E2E coefficients (95% CI):")
    for name, value in c.values.items():
        shown = "0" if c.status(name) in ("at bound", "not identifiable") else seconds(value)
        print(f"  {name:7s} {shown:>12s}  {coefficient_band(c, name)}")
    print(f"  R² {c.r2:.4f}, MAPE {percent(c.mape)}")
    print("per configuration (C1, C2 fitted alone):")
    for conf in m.configurations:
        fitted = ("" if conf.fit is None else
                  f"C1 {seconds(conf.fit.coefficients.values['C1'])}, C2 {seconds(conf.fit.coefficients.values['C2'])}, "
                  f"R² {conf.fit.coefficients.r2:.4f}, MAPE {percent(conf.fit.coefficients.mape)}")
        print(f"  {conf.label:10s} k={conf.k} E={conf.acceptance_length:.2f} runs={conf.n_runs} {fitted}")
    for by, result in report.cross_validation.items():
        o = result["overall"]
        errors = ", ".join(f"{t.upper()} {percent(o[t]['mape'])}" for t in ("e2e", "ttft", "tpot") if t in o)
        print(f"leave-one-{by}-out MAPE: {errors or 'n/a (no held-out run could be predicted)'}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


def _acceptance(args, model) -> tuple[float, str]:
    if args.alphas:
        alphas = _numbers(args.alphas)
        return acceptance_for(model, args.k, alphas)[0], "given per-position alpha"
    return acceptance_for(model, args.k, args.alpha)


def _drift(args: argparse.Namespace, m):
    """(the model predicting for --trace's fast gaps unless --arrival-cv says otherwise, the trace's drift,
    its length in requests), or (m, None, None) without --trace."""
    if not args.trace:
        return m, None, None
    from specserve.benchmark.arrival_schedules import load_trace

    times = load_trace(args.trace).times_s
    drift = fit_rate_drift(times)
    if args.arrival_cv is None:
        m = replace(m, e2e=replace(m.e2e, arrival_cv=drift.cv))
    return m, drift, times.size


def predict(args: argparse.Namespace) -> int:
    m, drift, horizon = _drift(args, _model(args))
    e, source = _acceptance(args, m)
    pred = m.predict(args.rate, args.k, e, args.output_tokens, args.prompt_tokens)
    dense = m.latency(args.rate, 0, 1.0, args.output_tokens, args.prompt_tokens)
    be = break_even_for(m, args.k, e) if args.k > 0 else None
    out = {"rate": pred.rate, "arrival_cv": m.arrival_cv, "k": pred.k, "acceptance_length": pred.acceptance_length,
           "acceptance_source": source,
           "output_tokens": pred.output_tokens, "prompt_tokens": pred.prompt_tokens,
           "C1_s": pred.demands.c1, "C2_s": pred.demands.c2, "saturation_rate": pred.saturation_rate,
           "in_flight": pred.in_flight, "e2e_s": pred.e2e, "ttft_s": pred.ttft, "tpot_s": pred.tpot,
           "quantiles_s": pred.quantiles, "dense_e2e_s": dense,
           "speedup": None if math.isinf(pred.e2e) and math.isinf(dense) else
           (math.inf if math.isinf(dense) else dense / pred.e2e),
           "break_even_rate": None if be is None else be.rate,
           "break_even_regime": None if be is None else be.regime,
           "unsupported": list(pred.unsupported)}
    if drift is not None:
        def over(k: int, expected: float) -> float:
            return over_drift(lambda r: m.latency(r, k, expected, args.output_tokens, args.prompt_tokens),
                              args.rate, drift, horizon)
        out["rate_drift"] = {"arrival_cv": drift.cv, "variance": drift.variance, "correlation_gaps": drift.correlation,
                             "e2e_s": over(args.k, e), "dense_e2e_s": over(0, 1.0)}
    classes = None
    if args.lengths:
        classes = length_classes(*read_lengths(args.lengths), 4)
    elif args.output_tokens is None and args.prompt_tokens is None and len(m.length_classes) > 1:
        classes = m.length_classes  # the fitted traffic was mixed: show what each length class sees
    if classes:
        mix, rows = m.predict_classes(args.rate, args.k, e, classes)
        out["length_classes"] = [{"prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens,
                                  "weight": c.weight, "e2e_s": l_, "ttft_s": t_} for c, l_, t_ in rows]
        out["mixture_e2e_s"] = mix.e2e
    if args.json:
        print(json.dumps(model_file.finite_json(out) | {"saturated": math.isinf(pred.e2e)}, indent=1))
        return 0
    print(f"k={pred.k}, E={pred.acceptance_length:.3f} ({source}), g={pred.output_tokens:.0f}, "
          f"p={pred.prompt_tokens:.0f}, rate {pred.rate:g} req/s, arrival-gap CV {m.arrival_cv:g}")
    print(f"  C1 {seconds(pred.demands.c1)}, C2 {seconds(pred.demands.c2)}, saturates at {pred.saturation_rate:.3g} req/s")
    print(f"  mean E2E {seconds(pred.e2e)}, TTFT {seconds(pred.ttft)}, TPOT {seconds(pred.tpot)}, "
          f"in flight {pred.in_flight:.3g}")
    if drift is not None:
        d = out["rate_drift"]
        print(f"  over the trace's rate drift (rate x (1 ± {math.sqrt(drift.within(horizon)):.2f}), correlated over "
              f"{drift.correlation:.0f} requests): mean E2E {seconds(d['e2e_s'])}"
              + (f", plain decoding {seconds(d['dense_e2e_s'])}" if pred.k > 0 else ""))
    for metric, qs in pred.quantiles.items():
        print(f"  {metric.upper()} " + ", ".join(f"{q} {seconds(v)}" for q, v in qs.items()))
    if pred.k > 0:
        speed = "n/a" if out["speedup"] is None else f"{out['speedup']:.3g}x"
        print(f"  plain decoding at this rate: {seconds(dense)}; speedup {speed}")
        print(f"  break-even: {be.regime}" + ("" if be.rate is None else f" at {be.rate:.3g} req/s"))
    for c in out.get("length_classes", []):
        print(f"  class p={c['prompt_tokens']:.0f} g={c['output_tokens']:.0f} ({c['weight']:.0%}): "
              f"E2E {seconds(c['e2e_s'])}, TTFT {seconds(c['ttft_s'])}")
    if pred.unsupported:
        print(f"  warning: the fitted runs cannot identify {', '.join(pred.unsupported)} for this configuration")
    return 0


def _share_text(share: dict[int, float] | None, best: int | None) -> str:
    """`4 (62%), 3 (38%)`: how often each k came out best over the fit's coefficient draws."""
    if not share:
        return "-"
    order = sorted(share, key=lambda k: (-share[k], k))
    return ", ".join(f"{k} ({share[k]:.0%})" for k in order if share[k] >= 0.01 or k == best)


def plan_command(args: argparse.Namespace) -> int:
    m = _model(args)
    ks = _numbers(args.ks, int)
    if args.replicas is not None:  # capacity planning: replicas for an SLO (capacity.py)
        from specserve.latency.decisions.capacity_report import capacity_command
        return capacity_command(args, m, ks, _numbers(args.rates) if args.rates else [])
    if not args.rates:
        raise SpecServeError("--rates is required (or --replicas to plan replicas for a trace)")
    target = None if args.slo_e2e_ms is None else args.slo_e2e_ms / 1e3
    outside = [] if args.extrapolate else outside_measured(m, ks)
    ranked = [k for k in ks if k not in outside]
    if not ranked:
        raise SpecServeError(f"none of k={','.join(map(str, ks))} was measured or lies between measured k "
                             f"({','.join(map(str, measured_ks(m)))}): pass --extrapolate to rank them anyway")
    rows = plan(m, _numbers(args.rates), ranked, args.alpha, target, args.extrapolate, args.draws, args.seed)
    _, uncertainty = coefficient_draws(m, min(args.draws, 1))
    expected, left_out = candidate_ks(m, ranked, args.alpha)
    measured = set(measured_ks(m))
    unmeasured = sorted(k for k in expected if k not in measured)
    sources = {k: acceptance_for(m, k, args.alpha)[1] for k in expected}
    dense_measured = args.extrapolate or not outside_measured(m, [0])
    breaks = {k: break_even_for(m, k, e) for k, e in expected.items() if k > 0} if dense_measured else {}
    most = None
    if target is not None:
        rates = {k: max_rate_within(m, k, e, target) for k, e in expected.items()}
        best = max(rates, key=lambda k: (rates[k], -k))
        most = {"k": best, "max_rate": rates[best]}
    if args.json:
        print(json.dumps(model_file.finite_json({
            "rows": [{"rate": r.rate, "best_k": r.best_k, "e2e_s": r.best, "dense_e2e_s": r.dense,
                      "speedup": r.speedup, "meets_slo": r.meets_target, "e2e_by_k_s": r.latencies,
                      "best_k_share": r.best_share, "e2e_ci95_s": None if r.best_band is None else list(r.best_band)}
                     for r in rows],
            "break_even": {k: {"regime": b.regime, "rate": b.rate, "acceptance_length": expected[k]}
                           for k, b in breaks.items()},
            "measured_k": sorted(measured), "unmeasured_k": unmeasured, "outside_measured_k": outside,
            "uncertainty": {"draws": args.draws, "from": uncertainty},
            "not_identifiable_k": left_out, "slo_e2e_ms": args.slo_e2e_ms, "best_under_slo": most}), indent=1))
        return 0
    mark = lambda k: "-" if k is None else f"{k}{'*' if k in unmeasured else ''}"  # noqa: E731
    draws = args.draws > 0 and uncertainty != "none"
    header = f"{'rate':>8s} {'best k':>6s} {'E2E':>12s}" + (f" {'95% band':>21s}" if draws else "")
    print(header + f" {'no SD':>12s} {'speedup':>8s}" + ("  SLO" if target else "")
          + ("  best k over the fit's uncertainty" if draws else ""))
    for r in rows:
        speed = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        slo = "" if r.meets_target is None else ("  met" if r.meets_target else "  MISSED")
        dense = ("n/a" if 0 in measured or args.extrapolate else "not measured") if r.dense is None else seconds(r.dense)
        band = ("" if not draws else " " + ("n/a" if r.best_band is None else
                                             f"{seconds(r.best_band[0])} to {seconds(r.best_band[1])}").rjust(21))
        share = f"  {_share_text(r.best_share, r.best_k)}" if draws else ""
        print(f"{r.rate:8.3g} {mark(r.best_k):>6s} {seconds(r.best):>12s}{band} {dense:>12s} {speed:>8s}{slo}{share}")
    print(f"measured k: {','.join(map(str, sorted(measured)))}")
    if unmeasured:
        print(f"* not measured, interpolated between measured k: k={','.join(map(str, unmeasured))}"
              + (" (with --extrapolate: or extrapolated)" if args.extrapolate else ""))
    if outside:
        print(f"not ranked, outside the measured range (--extrapolate ranks them): k={','.join(map(str, outside))}")
    if draws:
        how = ("the fit's covariance" if uncertainty == "covariance" else
               "the coefficients' 95% intervals taken as independent (this model file has no covariance: "
               "refit for the tighter, correlated spread)")
        print(f"uncertainty: {args.draws} coefficient draws from {how}; the share is how often each k came out "
              "best, the band the best k's mean E2E over the draws (acceptance taken as measured)")
        close = [r for r in rows if r.best_share and r.best_k is not None and r.best_share.get(r.best_k, 0) < 0.95]
        if close:
            print("the data do not settle the choice at " + ", ".join(f"{r.rate:g} req/s" for r in close)
                  + ": the runs leave more than 5% of draws preferring another k")
    if not dense_measured:
        print("break-even: not computed, plain decoding was not measured (--extrapolate predicts it)")
    if breaks:
        print("break-even (where SD and plain decoding are equally fast):")
    for k, b in breaks.items():
        where = "" if b.rate is None else f" at {b.rate:.3g} req/s"
        print(f"  k={mark(k)} (E={expected[k]:.2f}, {sources[k]}): {b.regime}{where}")
    if left_out:
        print(f"not ranked (the fitted runs cannot identify their cost): k={','.join(map(str, left_out))}")
    if most is not None:
        if most["max_rate"] <= 0:
            print(f"no k meets {args.slo_e2e_ms:g} ms even for a lone request")
        elif math.isinf(most["max_rate"]):
            print(f"k={mark(most['k'])} meets {args.slo_e2e_ms:g} ms at any rate (no contention measured)")
        else:
            print(f"most load within {args.slo_e2e_ms:g} ms mean E2E: {most['max_rate']:.3g} req/s with k={mark(most['k'])}")
    return 0


def explain(args: argparse.Namespace) -> int:
    print(explain_text(model_file.load(args.model), _numbers(args.ks, int), args.alpha, args.extrapolate))
    return 0


def plot(args: argparse.Namespace) -> int:
    from specserve.latency.decisions.plot import plot_all

    for path in plot_all(model_file.load(args.model), _runs(args), args.out_dir):
        print(path)
    return 0


def validate(args: argparse.Namespace) -> int:
    from specserve.latency.fitting.validate import GOALS, markdown, render, validate_files

    report = validate_files(args.results, _options(args, True), _pairs(args.k, int, "--k"),
                            _pairs(args.alpha, float, "--alpha"))
    if args.markdown:
        Path(args.markdown).write_text(markdown(report))
    if args.json:
        print(json.dumps(model_file.finite_json({
            "cross_validation": report.cross_validation, "e2e_mape_goals_pct": GOALS,
            "excluded": report.excluded, "notes": report.notes}), indent=1))
        return 0
    render(report)
    if args.markdown:
        print(f"wrote {args.markdown}")
    return 0
