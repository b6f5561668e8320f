"""Scale-out on Ray Serve (issues 48, 63): one replica against one process, 1 vs 2 replicas, the routers, the planner.

First, on one Ray replica (1 thread, plain decoding), a saturation burst (equal requests of the mix's mean
length) gives one replica's saturation rate S, and Poisson runs at --fit-loads x S (lengths drawn from the
mix: most requests short, a few long) are fitted with `specserve latency fit`'s code: the fit reaches the
loads it is asked about, and its C1 holds whatever the Ray hops cost. Then, --repeats times, each
configuration (started afresh, in an order rotated every repeat) replays the same traces, Poisson arrivals
at --loads x S, arrival for arrival:

    single             `specserve serve`, one process, 1 thread (no Ray)
    ray-1x1            `specserve serve --replicas 1` (HTTP answered by the serving process, --front process)
    ray-1x1-proxy      the same behind Ray Serve's HTTP proxy and ingress deployment (--front ray)
    ray-2x1-pow2       `--replicas 2`, 1 thread each, power of two choices
    ray-2x1-latency    `--replicas 2`, the latency-aware router with the fitted model
    (--spec adds single-sd and ray-2x1-pow2-sd: the default speculation, the shipped drafts, adaptive)

Every server first takes two bursts of --saturation-requests per replica: the first warms it up, the
second measures its saturation (for ray-1x1 and ray-2x1-pow2: 2 replicas' throughput against one's).
The servers run without prefix caching (see the prompt seeds below). The fitted model plans replicas for each trace (`specserve latency plan
--replicas`, a mean-E2E SLO, by default twice a lone request's), set beside what was measured.

    python bench/scaleout.py [--repeats 3] [--loads 0.5,0.8,1.1] [--spec] [--out bench/results/scaleout]

Writes OUT/runs.jsonl (+ per-request rows), OUT/fit.jsonl, OUT/model.json, OUT/trace-*.csv, OUT/plan-*.txt,
OUT/summary.md and OUT/summary.json; server logs in OUT/logs/. Prints the summary. Benchmark on an idle
machine (nothing else running): torch's threads slow many-fold when another process wants a core.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from specserve.benchmark.arrival_schedules import load_trace
from specserve.benchmark.machine import cpu_name, git_commit
from specserve.benchmark.prompts import load_tokenizer
from specserve.benchmark.results import append_run
from specserve.benchmark.runner import RunOptions, Target, run_once
from specserve.benchmark.sweep import measure_saturation
from specserve.benchmark.workload import WorkloadSpec
from specserve.latency.fitting import model_file
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs
from specserve.model.registry import resolve
from specserve.scaleout.process import ReplicaServer

sys.path.insert(0, str(Path(__file__).parent))
from scaleout_planner import check as planner_check  # noqa: E402 - bench/scaleout_planner.py, re-run on a folder

# label -> (replicas (None: one process, no Ray), extra `specserve serve` flags, speculation on)
CONFIGS = {
    "single": (None, [], False),
    "ray-1x1": (1, ["--router", "pow2"], False),
    "ray-1x1-proxy": (1, ["--router", "pow2", "--front", "ray"], False),
    "ray-2x1-pow2": (2, ["--router", "pow2"], False),
    "ray-2x1-latency": (2, ["--router", "latency"], False),
}
SPEC_CONFIGS = {"single-sd": (None, [], True), "ray-2x1-pow2-sd": (2, ["--router", "pow2"], True)}
SATURATION_CONFIGS = ("ray-1x1", "ray-2x1-pow2")


def write_trace(path: Path, n: int, rate: float, args, rng: np.random.Generator) -> None:
    """Azure-style CSV: Poisson arrivals at `rate`, prompt --input-len, output --short or, with probability
    --long-share, --long tokens."""
    gaps = rng.exponential(1.0 / rate, n)
    gaps[0] = 0.0
    times = np.cumsum(gaps)
    outputs = np.where(rng.random(n) < args.long_share, args.long, args.short)
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"{t:.6f},{args.input_len},{g}" for t, g in zip(times, outputs)]
    path.write_text("\n".join(rows) + "\n")


def server_args(args, label: str, model_json: Path | None) -> list[str]:
    replicas, extra, spec = {**CONFIGS, **SPEC_CONFIGS}[label]
    common = ["--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.threads),
              "--max-model-len", str(args.max_model_len), "--disable-access-log", "--no-enable-prefix-caching",
              *args.server_arg]
    common += [] if spec else ["--speculative-config", "none"]
    if replicas is None:
        return common
    latency = ["--latency-model", str(model_json)] if "latency" in extra and model_json else []
    return common + ["--replicas", str(replicas), *extra, *latency]


def mean_output(args) -> int:
    return round((1 - args.long_share) * args.short + args.long_share * args.long)


async def measure(target: Target, spec: WorkloadSpec, opts: RunOptions, results: Path, **info) -> dict:
    record, rows = await run_once(target, spec, opts, sweep_info=info or None)
    append_run(results, record, rows)
    e2e, ttft = record["e2e_s"], record["ttft_s"]
    print(f"  [{target.label}] {info} {record['num_completed']}/{record['num_requests']} ok, "
          f"{record['achieved_rate']:.3f} req/s, mean E2E {e2e['mean'] or float('nan'):.3f} s, "
          f"TTFT {ttft['mean'] or float('nan'):.3f} s", flush=True)
    return record


# Prompt seeds: every run sends prompts of its own (the same ones in every configuration). The data set's
# 480 prompts still overlap between runs, so the servers run without prefix caching: a burst that found
# its prompts cached from the previous one ran at twice the rate, and a replayed trace at half the latency.
FIT_SEED, COLD_SEED, WARM_SEED, TRACE_SEED = 1, 1000, 2000, 3000


def burst_spec(args, seed: int) -> WorkloadSpec:
    # A burst of the mix itself would measure its longest request (the short ones finish, the last long one
    # runs alone): the burst is of equal requests of the mix's mean output length instead.
    return WorkloadSpec(input_len=args.input_len, output_len=mean_output(args), dataset=args.dataset,
                        seed=args.seed + seed)


def warm_saturation(target: Target, args, opts: RunOptions, replicas: int) -> float:
    """Saturation rate of a fresh server, measured by a second burst after a first that warms it up."""
    n = args.saturation_requests * replicas
    cold = asyncio.run(measure_saturation(target, burst_spec(args, COLD_SEED), opts, n))
    warm = asyncio.run(measure_saturation(target, burst_spec(args, WARM_SEED), opts, n))
    print(f"  [{target.label}] bursts of {n} requests of {mean_output(args)} tokens: {cold:.3f} req/s cold, "
          f"{warm:.3f} warm (its saturation)", flush=True)
    return warm


def fit_phase(args, out: Path, opts: RunOptions) -> tuple[float, Path]:
    """One replica's saturation rate (burst) and a model fitted on Poisson runs up to --fit-loads of it."""
    server = ReplicaServer(server_args(args, "ray-1x1", None), out / "logs" / "fit.log")
    try:
        target = Target(base_url=server.root, label="fit-1x1", k=0, server_config={"replicas": 1, "k": 0})
        sat = warm_saturation(target, args, opts, 1)
        lengths = out / "lengths.csv"
        write_trace(lengths, 1000, 1.0, args, np.random.default_rng(args.seed))  # the mix; runs draw rows from it
        spec = WorkloadSpec(trace=str(lengths), dataset=args.dataset, seed=args.seed)
        fit_file = out / "fit.jsonl"
        for i, load in enumerate(args.fit_loads):
            run = replace(spec, request_rate=load * sat, max_requests=args.fit_requests, seed=args.seed + FIT_SEED + i)
            asyncio.run(measure(target, run, opts, fit_file, load=load))
    finally:
        server.stop()
    report = fit_runs(load_runs([fit_file]), FitOptions(cross_validate=False), [str(fit_file)])
    path = out / "model.json"
    model_file.save(report, path)
    c = report.model.e2e.demands(0, 1.0, report.model.output_tokens)
    print(f"  fitted: C1 {c.c1:.3f} s, C2 {c.c2:.3f} s at g={report.model.output_tokens:.0f} (1/C2 {1 / c.c2:.3g} "
          f"req/s), fitted up to {report.model.fitted_rate(0):.3g} req/s; excluded {len(report.excluded)} run(s)",
          flush=True)
    return sat, path


def spread(values: list[float]) -> dict:
    v = [x for x in values if x is not None]
    return {"median": float(np.median(v)), "min": min(v), "max": max(v), "n": len(v)} if v else {"median": None}


def fmt(d: dict, unit: str = "") -> str:
    if d.get("median") is None:
        return "-"
    return f"{d['median']:.3g}{unit} [{d['min']:.3g}-{d['max']:.3g}]" if d["n"] > 1 else f"{d['median']:.3g}{unit}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="threads per replica (default 1)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=160, help="requests in each trace (default 160)")
    floats = (lambda text: [float(x) for x in text.split(",")])
    p.add_argument("--loads", type=floats, default=[0.5, 0.8, 1.1],
                   help="trace rates, fractions of one replica's burst-measured saturation S (default 0.5,0.8,1.1)")
    p.add_argument("--fit-loads", type=floats, default=[0.2, 0.4, 0.6, 0.8, 1.0],
                   help="fit runs' rates, fractions of S (default: up to the loads asked about; runs past "
                        "saturation are left out by the fit)")
    p.add_argument("--fit-requests", type=int, default=80)
    p.add_argument("--saturation-requests", type=int, default=64, help="burst size (default 64 = max_num_seqs)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--short", type=int, default=8, help="output tokens of most requests")
    p.add_argument("--long", type=int, default=64, help="output tokens of the few long ones")
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dataset", default="spec-bench")
    p.add_argument("--spec", action="store_true", help="also the default speculation (single-sd, ray-2x1-pow2-sd)")
    p.add_argument("--configs", type=lambda text: text.split(","), default=None,
                   help=f"only these configurations (default: {','.join(CONFIGS)}, and with --spec "
                        f"{','.join(SPEC_CONFIGS)}); the planner check needs ray-1x1 and both 2x1 routers")
    p.add_argument("--slo-e2e-ms", type=float, help="the planner's mean-E2E SLO (default: 2x a lone request)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `specserve serve` flag (repeat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="idle machine", help="stated with the results (e.g. 'shared machine')")
    p.add_argument("--out", default="bench/results/scaleout")
    args = p.parse_args()

    configs = args.configs or list(CONFIGS) + (list(SPEC_CONFIGS) if args.spec else [])
    unknown = set(configs) - set(CONFIGS) - set(SPEC_CONFIGS)
    if unknown:
        p.error(f"unknown configurations {sorted(unknown)} (known: {', '.join([*CONFIGS, *SPEC_CONFIGS])})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.jsonl"):  # one measurement per folder: runs of an earlier one would be fitted too
        old.unlink()
    results = out / "runs.jsonl"
    opts = RunOptions(progress=False, tokenizer=load_tokenizer(str(resolve(args.model))),
                      max_model_len=args.max_model_len)
    started = time.time()
    print("fit: one Ray replica's saturation and Poisson runs below it", flush=True)
    sat, model_json = fit_phase(args, out, opts)
    rng = np.random.default_rng(args.seed + 100)
    traces, rates = {}, {}
    for load in args.loads:
        traces[load] = out / f"trace-{load:g}.csv"
        write_trace(traces[load], args.requests, load * sat, args, rng)
        rates[load] = load_trace(str(traces[load])).mean_rate  # what is replayed: a draw around load x sat
    runs: dict[tuple[str, float], list[dict]] = {}
    saturation: dict[str, list[float]] = {c: [] for c in SATURATION_CONFIGS if c in configs}
    for rep in range(args.repeats):
        order = configs[rep % len(configs):] + configs[:rep % len(configs)]
        for label in order:
            replicas, _, spec = {**CONFIGS, **SPEC_CONFIGS}[label]
            print(f"repeat {rep + 1}/{args.repeats}: {label}", flush=True)
            server = ReplicaServer(server_args(args, label, model_json), out / "logs" / f"{label}-{rep + 1}.log")
            try:
                if replicas:
                    server.wait_healthy(replicas)
                target = Target(server.root, label=label, k=None if spec else 0, server_config={"replicas": replicas or 0})
                rate = warm_saturation(target, args, opts, replicas or 1)  # also warms every server up
                if label in saturation:
                    saturation[label].append(rate)
                loads = args.loads[rep % len(args.loads):] + args.loads[:rep % len(args.loads)]
                for load in loads:
                    replay = WorkloadSpec(trace=str(traces[load]), dataset=args.dataset, max_requests=args.requests,
                                          seed=args.seed + TRACE_SEED + args.loads.index(load))
                    runs.setdefault((label, load), []).append(
                        asyncio.run(measure(target, replay, opts, results, load=load, repeat=rep + 1)))
            finally:
                server.stop()

    e2e = {key: spread([r["e2e_s"]["mean"] for r in rs]) for key, rs in runs.items()}
    ttft = {key: spread([r["ttft_s"]["mean"] for r in rs]) for key, rs in runs.items()}
    p99 = {key: spread([r["e2e_s"].get("p99") for r in rs]) for key, rs in runs.items()}
    failed = {key: sum(r["num_failed"] for r in rs) for key, rs in runs.items()}

    def ratio(a: str, b: str, metric: str, load: float) -> dict:  # paired within each repeat
        return spread([x[metric]["mean"] / y[metric]["mean"] for x, y in zip(runs[(a, load)], runs[(b, load)])])

    table = ["| configuration | load | rate req/s | mean E2E s | p99 E2E s | mean TTFT s | failed |",
             "|---|---|---|---|---|---|---|"]
    for label in configs:
        for load in args.loads:
            key = (label, load)
            table.append(f"| {label} | {load:g} | {rates[load]:.3g} | {fmt(e2e[key])} | {fmt(p99[key])} | "
                         f"{fmt(ttft[key])} | {failed[key]} |")
    goals = ["| ratio (paired per repeat; median [range]) | " + " | ".join(f"load {x:g}" for x in args.loads) + " |",
             "|---|" + "---|" * len(args.loads)]
    for name, a, b, metric in (("ray-1x1 / single, mean E2E", "ray-1x1", "single", "e2e_s"),
                               ("ray-1x1 / single, mean TTFT", "ray-1x1", "single", "ttft_s"),
                               ("ray-1x1-proxy / single, mean E2E", "ray-1x1-proxy", "single", "e2e_s"),
                               ("ray-1x1-proxy / single, mean TTFT", "ray-1x1-proxy", "single", "ttft_s"),
                               ("latency / pow2 (2 replicas), mean E2E", "ray-2x1-latency", "ray-2x1-pow2", "e2e_s")) + (
            (("sd / plain, single, mean E2E", "single-sd", "single", "e2e_s"),
             ("sd / plain, 2 replicas pow2, mean E2E", "ray-2x1-pow2-sd", "ray-2x1-pow2", "e2e_s")) if args.spec else ()):
        if a in configs and b in configs:
            goals.append(f"| {name} | " + " | ".join(fmt(ratio(a, b, metric, x)) for x in args.loads) + " |")
    if len(saturation) == 2:
        sat_ratio = spread([b / a for a, b in zip(saturation["ray-1x1"], saturation["ray-2x1-pow2"])])
        goals.append(f"\nSaturation (burst of {args.saturation_requests} per replica): 1 replica "
                     f"{fmt(spread(saturation['ray-1x1']), ' req/s')}, 2 replicas "
                     f"{fmt(spread(saturation['ray-2x1-pow2']), ' req/s')}; 2 / 1 = {fmt(sat_ratio)}.")
    # The planner against these runs, its co-location term fitted leave one load out (scaleout_planner.py),
    # and the term fitted on every load saved into model.json for `specserve latency plan`.
    planner, checks = (planner_check(out, args.slo_e2e_ms and args.slo_e2e_ms / 1e3)
                       if {"ray-1x1", "ray-2x1-pow2", "ray-2x1-latency"} <= set(configs) else (["(not run)"], []))
    commit = git_commit("?")
    mix = f"{1 - args.long_share:.0%} x {args.short} and {args.long_share:.0%} x {args.long} output tokens"
    header = (f"Model {args.model} {args.dtype}, {args.threads} thread(s) per replica; CPU {cpu_name()}, "
              f"{len(os.sched_getaffinity(0))} cores; {args.note}. Traces: {args.requests} Poisson "
              f"arrivals at {', '.join(f'{x:g}' for x in args.loads)} x one replica's burst saturation {sat:.3g} req/s, "
              f"{args.input_len}-token prompts, {mix}; {args.repeats} repeats, configurations in a rotated order. "
              f"Commit {commit}. Command: {' '.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}; "
              f"{(time.time() - started) / 60:.1f} min.")
    summary = "\n\n".join([header, "\n".join(table), "\n".join(goals), "Planner against measurement:\n\n"
                            + "\n".join(planner)])
    (out / "summary.md").write_text(summary + "\n")
    (out / "summary.json").write_text(json.dumps(model_file.finite_json({
        "header": header, "saturation_rps": sat, "saturation_by_config": saturation,
        "runs": {f"{c}@{x:g}": {"e2e_s": e2e[(c, x)], "ttft_s": ttft[(c, x)], "p99_e2e_s": p99[(c, x)],
                                "failed": failed[(c, x)]} for c, x in runs},
        "planner": checks}), indent=1) + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
