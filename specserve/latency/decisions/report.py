"""`specserve latency explain`: what the fitted coefficients say, in plain language."""
from __future__ import annotations

import math
from collections.abc import Sequence

from specserve.latency.equations.arrival_regularity import company
from specserve.latency.fitting.fit import FitReport
from specserve.latency.decisions.planning import best_k_bands, break_even_for, candidate_ks, measured_ks, outside_measured
from specserve.latency.fitting.regression import FittedCoefficients
from specserve.latency.fitting.tails import EXPONENTIAL_FACTOR


def seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf (saturated)"
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def term(c: FittedCoefficients, names: Sequence[str], amount: float) -> str:
    """`amount` (a cost built from the coefficients `names`) in words: a time where the data measured one,
    else what the data say instead. A value the non-negative fit pushed to its bound 0 is no measured
    cost, however many digits it has (it used to read "8.67e-13 ms of everyone's step time")."""
    statuses = [c.status(n) for n in names if n in c.values]
    if statuses and "not identifiable" in statuses and all(st in ("not identifiable", "at bound") for st in statuses):
        return f"a cost the runs cannot identify ({'/'.join(names)} held at 0)"
    if statuses and all(st == "at bound" for st in statuses):
        return (f"no cost the runs can tell from zero ({'/'.join(names)} at "
                f"{'its' if len(names) == 1 else 'their'} lower bound 0)")
    return seconds(amount)


def _unresolved(c: FittedCoefficients, names: Sequence[str]) -> bool:
    """Every coefficient a demand is built from is at its bound or not identifiable: the demand is no
    measurement, and ratios to it (C1R) mean nothing."""
    return all(c.status(n) in ("at bound", "not identifiable") for n in names if n in c.values)


def coefficient_band(c: FittedCoefficients, name: str) -> str:
    """The 95% interval of one coefficient, or what the data say instead of one."""
    status = c.status(name)
    ci = c.ci95.get(name)
    if status == "not identifiable":
        return "not identifiable from these runs (held at 0)"
    if status == "at bound":
        return ("at its lower bound 0: the runs cannot tell it from zero"
                + ("" if ci is None or ci[1] <= 0 else f" (95% CI up to {seconds(ci[1])})"))
    if ci is None:
        return "no CI"
    band = f"[{seconds(max(ci[0], 0.0)) if ci[0] > 0 else '0'}, {seconds(ci[1])}]"
    return band + (" (the interval reaches 0: not resolved from zero)" if status == "unresolved" else "")


def percent(value: float | None) -> str:
    return "n/a" if value is None or math.isnan(value) else ("inf" if math.isinf(value) else f"{value:.2f}%")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _quality(report: FitReport) -> list[str]:
    e2e = report.model.e2e.coefficients
    q = report.quality
    lines = [f"Fit: pooled E2E R² = {e2e.r2:.4f}; in-sample MAPE: E2E {percent(q.get('e2e', {}).get('mape'))}, "
             f"TTFT {percent(q.get('ttft', {}).get('mape'))}, TPOT {percent(q.get('tpot', {}).get('mape'))}."]
    names = {"rate": "held-out rates", "configuration": "held-out configurations", "k": "held-out k"}
    for by, result in report.cross_validation.items():
        o = result["overall"]
        lines.append(f"Cross-validation, {names[by]}: MAPE E2E {percent(o.get('e2e', {}).get('mape'))}, "
                     f"TTFT {percent(o.get('ttft', {}).get('mape'))}, TPOT {percent(o.get('tpot', {}).get('mape'))}.")
    if e2e.not_identifiable:
        lines.append("Not identifiable from these runs (held at 0): " + ", ".join(e2e.not_identifiable)
                     + ". Predictions that need them are flagged.")
    return lines


def _configuration(report: FitReport, k: int, e: float, g: float, p: float, source: str) -> list[str]:
    m = report.model
    c = m.e2e.coefficients
    # C1 of a lone request; C2 where a growing queue ends up (full expert coverage for MoE).
    dense, sd = m.demands(0, 1.0, g, p), m.demands(k, e, g, p)
    dense_sat, sd_sat = m.saturation_rate(0, 1.0, g, p), m.saturation_rate(k, e, g, p)
    # plain decoding's lone latency is c1p + g·c1v: when the runs leave both at 0, no ratio to it is a measurement
    dense_c1_known = not _unresolved(c, ("c1p", "c1v", "c1p_s", "c1v_s")) and dense.c1 > 0
    c1r = sd.c1 / dense.c1 if dense_c1_known else None
    c2r = dense_sat / sd_sat if math.isfinite(dense_sat) else (1.0 if math.isinf(sd_sat) else math.inf)
    be = break_even_for(m, k, e, g, p)
    lines = [f"k={k}, E={e:.2f} tokens per cycle ({source}, {g:.0f} output tokens): "
             f"C1R = {'n/a' if c1r is None else f'{c1r:.2f}'}, C2R = {c2r:.2f}."]
    if c.not_identifiable:
        lines.append(f"  ({', '.join(c.not_identifiable)} could not be separated from the other coefficients "
                     "and are held at 0: read the per-term costs below with that in mind.)")
    saved, drafted = e - 1.0, k
    # Per-term costs; with MoE the expert part at a lone request's coverage (C1) or full coverage (C2).
    lone = m.e2e.moe.coverage(k + 1) if m.e2e.moe else 0.0
    cost = lambda name, phi: c[name] + phi * c.values.get(name + "_s", 0.0)  # noqa: E731
    # the names a per-term cost is built from (the expert part too, with MoE), to say when it is no measurement
    parts = lambda name: [name] + ([name + "_s"] if name + "_s" in c.values else [])  # noqa: E731
    alone = ("  Alone, plain decoding's latency is not resolved by these runs (c1p and c1v at 0), so no "
             "zero-load speedup is claimed" if c1r is None else
             f"  Alone, a request is {1 / c1r:.2f}x as fast as plain decoding (1/C1R)")
    lines.append(f"{alone}: each cycle adds "
                 f"{_count(k, 'draft step')} ({term(c, parts('c1d'), k * cost('c1d', lone))}) to a verify pass "
                 f"({term(c, parts('c1v'), cost('c1v', lone))}) and commits {e:.2f} tokens instead of 1.")
    if c2r > 1:
        lines.append(f"  Under load the speedup shrinks: each request in flight loads the shared batch with "
                     f"{_count(drafted, 'drafted token')} per cycle ({term(c, parts('c2d'), k * cost('c2d', 1.0))} "
                     f"of everyone's step time) but only {saved:.2f} are accepted, saving "
                     f"{term(c, parts('c2v'), saved * cost('c2v', 1.0))} of decode steps; "
                     f"so a co-resident costs {c2r:.2f}x as much as without SD (C2R > 1).")
    else:
        lines.append(f"  Under load SD keeps paying: the {saved:.2f} accepted tokens per cycle save more batch "
                     f"time than the {_count(drafted, 'drafted token')} cost (C2R = {c2r:.2f} <= 1).")
    if be.regime == "sd-wins-below":
        lines.append(f"  Break-even at {be.rate:.3g} req/s (dense load r* = {be.dense_load:.2f}): above it plain "
                     "decoding is faster.")
    elif be.regime == "sd-wins-above":
        lines.append(f"  SD loses at low load and wins above {be.rate:.3g} req/s.")
    else:
        lines.append("  SD wins at every sustainable rate." if be.regime == "sd-always-wins"
                     else "  SD never wins at this acceptance." if be.regime == "sd-never-wins"
                     else "  SD and plain decoding are indistinguishable.")
    if math.isfinite(dense_sat):
        lines.append(f"  Saturation: {sd_sat:.3g} req/s with SD vs {dense_sat:.3g} without (x{1 / c2r:.2f} = 1/C2R).")
    else:
        lines.append("  No contention was measured without SD (C2 = 0), so no saturation rate to compare.")
    return lines


def explain(report: FitReport, ks: Sequence[int] = (0, 1, 2, 3, 4, 5, 6, 7, 8),
            alpha: float | None = None, extrapolate: bool = False) -> str:
    m = report.model
    n_runs = sum(c.n_runs for c in m.configurations)
    out = [f"Latency model from {n_runs} pre-saturation runs of {len(m.configurations)} configurations "
           f"(mean {m.prompt_tokens:.0f} prompt / {m.output_tokens:.0f} output tokens)."]
    if report.excluded:
        out.append(f"Excluded {len(report.excluded)} saturated run(s):")
        out += [f"  - {x['label']} at {x['achieved_rate']:.3g} req/s: {'; '.join(x['reasons'])}"
                for x in report.excluded]
    out += _quality(report)
    dense, sat = m.demands(0, 1.0), m.saturation_rate(0, 1.0)
    c = m.e2e.coefficients
    if 0 not in measured_ks(m):
        out += ["", "Plain decoding was not measured: what follows for it is extrapolated from the speculative runs."]
    out += ["", f"Plain decoding ({m.output_tokens:.0f} output tokens): "
            f"C1 = {term(c, ['c1p', 'c1v'], dense.c1)} (a lone request's "
            f"latency), C2 = {seconds(m.e2e.demands(0, 1.0, m.output_tokens).c2)} (added per request in flight); latency is "
            f"C1/(1 - rate x C2) and saturates at {sat:.3g} req/s."]
    if m.arrival_cv != 1.0:
        kind = "more regular" if m.arrival_cv < 1.0 else "burstier"
        offset = float(company(1e3, m.arrival_cv, m.lifetimes)) - 1e3  # the high-load shift of company
        mix = ("" if m.lifetimes.equal else " (less than the 1 - CV² of equal lengths: in a mix of lengths a short "
               "request arriving right behind a long one meets it however regular the gaps)")
        out.append(f"Arrivals: the runs' gaps have CV {m.arrival_cv:g}, {kind} than Poisson's 1, so a request in "
                   f"flight with B = rate x L others on average meets {'fewer' if m.arrival_cv < 1.0 else 'more'} "
                   f"of them: about B {'-' if offset < 0 else '+'} {abs(offset):.2g} at high load{mix}"
                   f"{', none while B < 1' if m.arrival_cv < 0.5 and m.lifetimes.equal else ''}. Latency solves "
                   "L = C1 + C2 x company(rate x L) instead (predict --arrival-cv 1 for Poisson traffic).")
    if m.e2e.slots is not None:
        out.append(f"Slots: the server runs at most {m.e2e.slots} requests at once; the rest wait for a slot "
                   f"(Erlang's M/G/c queue, docs/latency.md), part of their TTFT, and plain decoding saturates "
                   f"at {sat:.3g} req/s, when every slot is busy, not at 1/C2.")
    if m.e2e.moe is not None:
        moe = m.e2e.moe
        out.append(f"Mixture of experts ({moe.active} of {moe.experts} active): a lone decode step touches "
                   f"{moe.coverage(1):.0%} of the experts; demands grow toward full coverage with load.")
    sd_ks = [k for k in ks if k > 0]
    for conf in m.configurations:
        if conf.k > 0:
            a = "" if conf.alpha is None else f", alpha {conf.alpha:.3f}"
            out += [""] + _configuration(report, conf.k, conf.acceptance_length, conf.output_tokens,
                                         conf.prompt_tokens, f"measured {conf.label}{a}")
    if sd_ks and (alpha is not None or m.typical_alpha() is not None):
        out += ["", "Best k by rate" + (f" (alpha = {alpha})" if alpha is not None else
                                        " (measured E where k was run, else the median fitted alpha)") + ":"]
        outside = [] if extrapolate else outside_measured(m, ks)
        ranked = [k for k in ks if k not in outside]
        bands = best_k_bands(m, ranked, alpha) if ranked else []
        left_out = candidate_ks(m, ranked, alpha)[1] if ranked else []
        if left_out:
            out.append(f"  (not ranked, the runs cannot identify their cost: k={','.join(map(str, left_out))})")
        if outside:
            out.append(f"  (not ranked, outside the measured k {','.join(map(str, measured_ks(m)))}: "
                       f"k={','.join(map(str, outside))}; --extrapolate ranks them)")
        measured = set(measured_ks(m))
        for k, lo, hi in bands:
            name = ("no SD" if k == 0 else f"k={k}") + ("" if k in measured else " (not measured)")
            out.append(f"  {name}: from {lo:.3g} req/s" if math.isinf(hi) else f"  {name}: {lo:.3g} to {hi:.3g} req/s")
        out.append("  Long drafts pay at low load, where C1 dominates; short or none near saturation, where C2 "
                   "does. Above the last band no k sustains the rate.")
    out += ["", *_phases(report)]
    if report.notes:
        out += ["", "Notes:"] + [f"  - {n}" for n in report.notes]
    return "\n".join(out)


def _phases(report: FitReport) -> list[str]:
    m = report.model
    t, s = m.ttft.coefficients, m.tpot.coefficients
    tt = lambda name: term(t, [name], t[name])  # noqa: E731
    st = lambda name: term(s, [name], s[name])  # noqa: E731
    if "t1d" in t.values:  # a model file written before TTFT's load rode on the cycle (phases.LEGACY_TTFT)
        ttft = (f"TTFT: {tt('t1')} alone (+{tt('t1d')} draft prefill with SD); once others are "
                f"decoding, the running step's fixed cost adds up to {tt('tb')} (+{tt('tb_d')} per "
                f"drafted token), and each request in flight {tt('t2')} (+{tt('t2d')} per drafted token).")
    else:
        ttft = (f"TTFT: {tt('t1')} alone; a busy batch adds {t['tw']:.2f} cycles (the rest of the step in "
                f"progress and the others' share of the prefill's step); with SD, arrivals during a draft "
                f"catch-up wait {t['tc']:.2f} x its D/2.")
    lines = [ttft,
             f"TPOT: a cycle takes {st('s1v')} + {st('s1d')} per drafted token alone; each "
             f"request in flight adds {st('s2v')} + {st('s2d')} per drafted token; divided by "
             "the E tokens a cycle commits."]
    if m.draft_catch_up is not None:
        lines.append(f"Draft catch-up: a request's first speculative step takes {seconds(m.draft_catch_up)} "
                     "longer (the draft's pass over the prompt); TPOT spreads its own and its company's.")
    if m.prefill_per_token is not None:
        lines.append(f"Prefill: {seconds(m.prefill_per_token)} per prompt token.")
    for metric, by_q in m.tails.coefficients.items():
        for q, c in by_q.items():
            lines.append(f"{metric.upper()} {q} ~ {c['a']:.2f} x lone + {c['b']:.2f} x load delay "
                         f"(an exponential delay would give {EXPONENTIAL_FACTOR[q]:.2f}); MAPE {percent(c.mape)}.")
    return lines
