"""`specserve latency plan MODEL --replicas`: the capacity plan (capacity.py) as text or JSON."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from specserve.errors import SpecServeError
from specserve.latency.fitting import model_file
from specserve.latency.decisions.capacity import CapacityPlan, Option, Slo, Traffic, plan_capacity, split_cv
from specserve.latency.equations.lengths import LengthClass, length_classes, read_lengths
from specserve.latency.decisions.report import seconds

N_CLASSES = 4


def mix_classes(prompt, output) -> tuple[LengthClass, ...]:
    """Length classes of a traffic: one per output length when there are few (a skewed mix of a few lengths,
    which quantile bins would merge: with 80 % at one length every inner quantile lands on it), else
    lengths.length_classes' quantile bins."""
    p, g = np.asarray(prompt, float), np.maximum(np.asarray(output, float), 1.0)
    values = np.unique(g)
    if len(values) > N_CLASSES:
        return length_classes(p, g, N_CLASSES)
    return tuple(LengthClass(float(p[g == v].mean()), float(v), float((g == v).mean())) for v in values)


def traffic_from_args(args: argparse.Namespace, rate: float | None) -> Traffic:
    """The rate and length mix: --trace gives both (its arrivals' mean rate, time-scaled, and its token
    columns), --lengths a mix, --rates the rate (overriding a trace's)."""
    classes, source, trace_rate = None, "", None
    if args.trace:
        from specserve.benchmark.arrival_schedules import load_trace

        trace = load_trace(args.trace)
        trace_rate = trace.mean_rate / args.time_scale
        source = f"trace {args.trace}: {len(trace)} requests, {trace_rate:.3g} req/s"
        if trace.input_tokens is not None and trace.output_tokens is not None:
            classes = mix_classes(trace.input_tokens, trace.output_tokens)
    if args.lengths:
        classes = mix_classes(*read_lengths(args.lengths))
        source = (source + "; " if source else "") + f"lengths from {args.lengths}"
    rate = rate if rate is not None else trace_rate
    if rate is None or not math.isfinite(rate):
        raise SpecServeError("give the traffic's rate: --rates R, or --trace FILE with arrival times")
    return Traffic(rate, classes, args.arrival_cv, source)


def _option_row(o: Option, slo: Slo) -> dict:
    p = o.at_replicas
    return {"k": o.k, "acceptance_length": o.expected, "replicas": o.replicas,
            "per_replica_rate": None if p is None else p.rate,
            "e2e_s": None if p is None else p.e2e, "ttft_s": None if p is None else p.ttft,
            "tpot_s": None if p is None else p.tpot,
            "slo_values_s": None if p is None else {m: slo.value(p, m) for m in slo.bounds},
            "capacity_per_replica": o.per_replica_capacity,
            "break_even": None if o.break_even is None else {"regime": o.break_even.regime,
                                                             "rate_per_replica": o.break_even.rate}}


def to_json(plan: CapacityPlan, cv: float) -> dict:
    best, dense, sd = plan.best, plan.dense, plan.best_speculative
    return model_file.finite_json({
        "rate": plan.traffic.rate, "source": plan.traffic.source, "arrival_cv": cv, "slo": plan.slo.describe(),
        "length_classes": None if not plan.traffic.classes else [
            {"prompt_tokens": c.prompt_tokens, "output_tokens": c.output_tokens, "weight": c.weight}
            for c in plan.traffic.classes],
        "options": [_option_row(o, plan.slo) for o in plan.options],
        "replicas_without_speculation": None if dense is None else dense.replicas,
        "replicas_with_speculation": None if sd is None else sd.replicas,
        "best": None if best is None else {"k": best.k, "replicas": best.replicas},
        "not_identifiable_k": plan.not_ranked,
        "by_replica_count": [{"replicas": n, "per_replica_rate": plan.traffic.rate / n,
                              "e2e_s_by_k": {k: p.e2e for k, p in preds.items()},
                              "meets_slo_by_k": {k: plan.slo.met(p) if math.isfinite(p.e2e) else False
                                                 for k, p in preds.items()},
                              "beyond_fit_by_k": {k: plan.beyond_fit(n, k) for k in preds},
                              "beyond_measured_replicas": plan.beyond_measured(n)}
                             for n, preds in plan.by_count],
        "colocation": None if plan.colocation is None else plan.colocation.to_dict()})


def _label(o: Option) -> str:
    return "no SD" if o.k == 0 else f"k={o.k}"


def _colocation_text(plan: CapacityPlan) -> str:
    if plan.colocation is None:
        return "replicas as independent copies of the fitted one (the model file has no co-location term)"
    return "co-location: each of N replicas on one machine is the fit with C1 x s1(N), C2 x s2(N): " + ", ".join(
        f"N={s.replicas} s1 {s.c1:.3g} s2 {s.c2:.3g}" for s in plan.colocation.slowdowns)


def render(plan: CapacityPlan, cv: float) -> str:
    t, slo = plan.traffic, plan.slo
    mix = "the fitted runs' lengths" if not t.classes else ", ".join(
        f"p={c.prompt_tokens:.0f}/g={c.output_tokens:.0f} {c.weight:.0%}" for c in t.classes)
    lines = [f"capacity for {t.rate:.3g} req/s ({t.source or 'given rate'}); lengths: {mix}; arrival-gap CV "
             f"{cv:g}", f"SLO: {slo.describe()}; requests spread evenly (random split: an upper bound for the "
             f"power-of-two and latency-aware routers)",
             _colocation_text(plan),
             f"{'config':>8s} {'E':>5s} {'replicas':>8s} {'req/s each':>10s} {'E2E':>10s} {'TTFT':>10s} "
             f"{'TPOT':>10s} {'capacity/replica':>16s}"]
    for o in plan.options:
        p = o.at_replicas
        cap = "inf" if math.isinf(o.per_replica_capacity) else f"{o.per_replica_capacity:.3g} req/s"
        if p is None:
            lines.append(f"{_label(o):>8s} {o.expected:5.2f} {'> max':>8s} {'-':>10s} {'-':>10s} {'-':>10s} "
                         f"{'-':>10s} {cap:>16s}")
            continue
        lines.append(f"{_label(o):>8s} {o.expected:5.2f} {o.replicas:8d} {p.rate:10.3g} {seconds(p.e2e):>10s} "
                     f"{seconds(p.ttft):>10s} {seconds(p.tpot):>10s} {cap:>16s}")
    best, dense, sd = plan.best, plan.dense, plan.best_speculative
    if best is None:
        lines.append("no configuration meets the SLO within the replica limit (or a lone request misses it)")
    else:
        alt = []
        if dense is not None:
            alt.append("without speculation: " + (f"{dense.replicas}" if dense.replicas else "more than the limit"))
        if sd is not None:
            alt.append(f"with speculation: {sd.replicas} (k={sd.k})")
        lines.append(f"-> {best.replicas} replica(s) with {_label(best)}" + (f" ({'; '.join(alt)})" if alt else "")
                     + (f"; ? more replicas than the {plan.colocation.measured} measured together: each assumed "
                        f"no slower than at {plan.colocation.measured}" if plan.beyond_measured(best.replicas) else ""))
    if plan.by_count:
        ks = [o.k for o in plan.options]
        lines.append("mean E2E per replica count (* meets the SLO; ? past the fitted runs' highest rate, "
                     "so not chosen" + (f", or more replicas than the {plan.colocation.measured} measured together"
                                        if plan.colocation else "") + "):")
        lines.append(f"{'replicas':>8s} {'req/s each':>10s} " + " ".join(f"{_label(o):>14s}" for o in plan.options))
        for n, preds in plan.by_count:
            cells = []
            for k in ks:
                p = preds[k]
                ok = math.isfinite(p.e2e) and plan.slo.met(p)
                if plan.beyond_fit(n, k):
                    mark = " ?"
                elif plan.beyond_measured(n):
                    mark = "*?" if ok else " ?"
                else:
                    mark = " *" if ok else "  "
                cells.append(f"{(seconds(p.e2e) if math.isfinite(p.e2e) else 'saturated') + mark:>14s}")
            lines.append(f"{n:8d} {t.rate / n:10.3g} " + " ".join(cells))
    for o in plan.options:
        b = o.break_even
        if b is None:
            continue
        where = "" if b.rate is None else f" at {b.rate:.3g} req/s per replica"
        total = "" if b.rate is None or best is None else f" (x {best.replicas} replicas = {b.rate * best.replicas:.3g} req/s in all)"
        lines.append(f"break-even k={o.k}: {b.regime}{where}{total}")
    if plan.not_ranked:
        lines.append(f"not ranked (the fitted runs cannot identify their cost): k={','.join(map(str, plan.not_ranked))}")
    return "\n".join(lines)


def capacity_command(args: argparse.Namespace, model, ks: list[int], rates: list[float]) -> int:
    slo = Slo(*(None if v is None else v / 1e3 for v in (args.slo_e2e_ms, args.slo_ttft_ms, args.slo_tpot_ms)),
              stat=args.slo_stat)
    colocation = model_file.load_colocation(args.model)
    outputs = []
    for rate in rates or [None]:
        traffic = traffic_from_args(args, rate)
        plan = plan_capacity(model, traffic, slo, ks, args.alpha, args.replicas, colocation)
        cv = split_cv(model.arrival_cv if traffic.cv is None else traffic.cv, 1)
        outputs.append(to_json(plan, cv) if args.json else render(plan, cv))
    print(json.dumps(outputs if len(outputs) > 1 else outputs[0], indent=1) if args.json else "\n\n".join(outputs))
    return 0
