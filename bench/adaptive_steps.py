"""Where a policy's time goes, step by step, against plain decoding on the same arrivals: one level of
bench/adaptive.py's mixed bursty evaluation replayed for each policy, rounds interleaved, and every engine
step's phases summed by kind of step (decode only, decode + prefill, prefill only; drafting or not).

    python bench/adaptive_steps.py --policies none,off,adaptive --level 0.5 --repeats 3   # ~10 min here

Greedy output is identical under every policy, so each run commits the same tokens: a policy that loses
spends more engine time on them (busy s), or spends it later (queueing: TTFT). Per run it prints busy time
by phase (schedule, draft, forward, sample, other) and by kind of step, steps, tokens committed per decode
row, draft tokens and accepted ones per drafting step, and the step cost model's measured / predicted.
Writes runs.jsonl (one line per run, per-kind sums) and summary.md under bench/results/adaptive_steps/<name>.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from adaptive import (build_engines, prompts_and_arrivals, replay, sampling, saturation,  # noqa: E402
                      use_policy)

from specserve.benchmark.machine import git_commit  # noqa: E402

OUT = Path(__file__).parent / "results" / "adaptive_steps"
PHASES = ("t_schedule", "t_draft", "t_forward", "t_sample", "t_other")


def kind(s) -> str:
    if not s.num_decodes:
        return "prefill"
    part = "decode+prefill" if s.num_prefill_tokens else "decode"
    return part + (", drafting" if sum(s.draft_lengths) else "")


def replay_steps(llm, texts, times, params, streams) -> dict:
    """adaptive.replay's run, each step's stats also summed by kind of step."""
    kinds: dict[str, dict] = {}
    ratio, planned, factors = [], [], []  # planned: (drafted, rows, committed, measured s, predicted s, planned tokens, plain s)

    def on_step(s, outs) -> None:
        committed = sum(len(out.delta_token_ids) for out in outs)
        k = kinds.setdefault(kind(s), {"steps": 0, "rows": 0, "prefill_tokens": 0, "draft_tokens": 0,
                                       "accepted": 0, "committed": 0, **{p: 0.0 for p in PHASES}})
        k["steps"] += 1
        k["rows"] += s.num_decodes
        k["prefill_tokens"] += s.num_prefill_tokens
        k["draft_tokens"] += sum(s.draft_lengths)
        k["accepted"] += s.num_accepted_tokens
        k["committed"] += committed
        for p in PHASES:
            k[p] += getattr(s, p)
        if s.t_predicted:
            ratio.append((s.t_draft + s.t_forward) / s.t_predicted)
            factors.append(llm.engine.models.drafting.factor)
        if s.planned_tokens is not None and s.num_decodes and not s.num_prefill_tokens:
            planned.append((sum(s.draft_lengths), s.num_decodes, committed, s.t_draft + s.t_forward, s.t_predicted,
                            s.planned_tokens, s.planned_plain_s))

    r = replay(llm, texts, times, params, streams, on_step)
    return {"mean_e2e": r["mean_e2e"], "mean_ttft": r["mean_ttft"], "kinds": kinds,
            "busy_s": sum(k[p] for k in kinds.values() for p in PHASES),
            "measured_over_predicted": statistics.median(ratio) if ratio else None,
            "decisions": decisions(planned),
            # the drafting steps' measured over predicted added time, as the policy charged it (DraftingError)
            "drafting_factor": [min(factors), statistics.median(factors), max(factors)] if factors else None}


def decisions(planned: list[tuple]) -> dict:
    """The policy's predictions against what its decode-only steps did (sums over the steps, so that long
    and short steps weigh by their time): tokens per row it expected and got; step time over plain
    decoding's predicted time, expected and measured; the gain (goodput over plain decoding's) both imply.
    Steps that drafted nothing show how right the prediction of a plain step was."""
    out = {}
    for name, sel in (("drafting", lambda p: p[0] > 0), ("not drafting", lambda p: p[0] == 0)):
        steps = [p for p in planned if sel(p)]
        if not steps:
            continue
        rows, committed, measured, predicted, tokens, plain = (sum(p[i] for p in steps) for i in range(1, 7))
        out[name] = {"steps": len(steps), "tokens_per_row_planned": tokens / rows,
                     "tokens_per_row_measured": committed / rows, "time_over_plain_planned": predicted / plain,
                     "time_over_plain_measured": measured / plain,
                     "gain_planned": (tokens / predicted) / (rows / plain),
                     "gain_measured": (committed / measured) / (rows / plain)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="none,off,adaptive")
    ap.add_argument("--level", type=float, default=0.5, help="fraction of plain decoding's saturation rate")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--name", default=datetime.datetime.now().strftime("%Y-%m-%d-%H%M"))
    args = ap.parse_args()
    out = OUT / args.name
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps({"command": "python bench/adaptive_steps.py " + " ".join(sys.argv[1:]),
                                               "commit": git_commit("?"), "started": datetime.datetime.now().isoformat(
                                                   timespec="seconds")}, indent=1))
    engines = build_engines("mix", args.threads, args.policies.split(","))
    sat = saturation(engines, "mix", 16)
    print(f"plain decoding saturates at {sat:.3f} req/s", flush=True)
    rows = []
    with (out / "runs.jsonl").open("a") as log:
        for repeat in range(args.repeats):
            policies = args.policies.split(",")
            random.Random(repeat).shuffle(policies)
            for policy in policies:
                llm = use_policy(engines, policy)
                texts, times, streams = prompts_and_arrivals(llm, "mix", args.level * sat, args.requests, seed=repeat)
                r = replay_steps(llm, texts, times, sampling(streams, args.temperature, repeat, None), streams)
                rows.append(dict(policy=policy, repeat=repeat, level=args.level, saturation=sat, **r))
                log.write(json.dumps(rows[-1]) + "\n")
                log.flush()
                print(f"r{repeat} {policy:9} E2E {r['mean_e2e']:.2f} s, TTFT {r['mean_ttft']:.2f} s, "
                      f"busy {r['busy_s']:.2f} s", flush=True)
    text = summary(rows)
    (out / "summary.md").write_text(text)
    print(text)


def summary(rows: list[dict]) -> str:
    lines = ["| round | policy | E2E s | TTFT s | busy s | kind of step | steps | ms/step | rows/step | "
             "prefill tok/step | draft tok/step | accepted/draft | committed/row | draft ms | forward ms | "
             "host ms (sched+sample+other) |", "|" + "---|" * 16]
    for r in sorted(rows, key=lambda r: (r["repeat"], r["policy"])):
        first = True
        for name, k in sorted(r["kinds"].items()):
            n = k["steps"]
            busy = sum(k[p] for p in PHASES)
            head = (f"| {r['repeat']} | {r['policy']} | {r['mean_e2e']:.2f} | {r['mean_ttft']:.2f} | {r['busy_s']:.2f}"
                    if first else "| | | | |")
            first = False
            lines.append(f"{head} | {name} | {n} | {1e3 * busy / n:.1f} | {k['rows'] / n:.2f} | "
                         f"{k['prefill_tokens'] / n:.1f} | {k['draft_tokens'] / n:.2f} | "
                         f"{k['accepted'] / k['draft_tokens'] if k['draft_tokens'] else 0:.2f} | "
                         f"{k['committed'] / k['rows'] if k['rows'] else 0:.2f} | {1e3 * k['t_draft'] / n:.1f} | "
                         f"{1e3 * k['t_forward'] / n:.1f} | "
                         f"{1e3 * (k['t_schedule'] + k['t_sample'] + k['t_other']) / n:.1f} |")
    lines += ["", "The adaptive policy's decode-only steps: what its plan predicted against what happened (sums "
              "over the steps; time over plain = the step's time / the predicted time of the same step without "
              "drafts; gain = goodput over plain decoding's).", "",
              "| round | policy | steps | step kind | tokens/row planned | measured | time/plain planned | measured |"
              " gain planned | measured |", "|" + "---|" * 10]
    for r in sorted(rows, key=lambda r: (r["repeat"], r["policy"])):
        for name, d in r.get("decisions", {}).items():
            lines.append(f"| {r['repeat']} | {r['policy']} | {d['steps']} | {name} | "
                         f"{d['tokens_per_row_planned']:.2f} | "
                         f"{d['tokens_per_row_measured']:.2f} | {d['time_over_plain_planned']:.2f} | "
                         f"{d['time_over_plain_measured']:.2f} | {d['gain_planned']:.2f} | {d['gain_measured']:.2f} |")
    factors = [(r["repeat"], r["policy"], r["drafting_factor"]) for r in sorted(rows, key=lambda r: r["repeat"])
               if r.get("drafting_factor") and r["policy"] != "off"]
    if factors:
        lines += ["", "Drafting steps' measured over predicted added time, as the policy charged it "
                  "(predictors.DraftingError), over the run's steps: " + "; ".join(
                      f"round {i} {p}: {f[1]:.2f} ({f[0]:.2f}-{f[2]:.2f})" for i, p, f in factors)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
