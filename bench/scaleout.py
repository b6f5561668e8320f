"""Scale-out on Ray Serve (issue 48): one trace through 1 and 2 replicas, the two routers, and the planner.

The same trace (Poisson arrivals at a rate one replica can barely sustain, a skewed length mix: most
requests short, a few long) is replayed, arrival for arrival, against:

    single        `specserve serve`, one process, 1 thread (no Ray: what Ray's hops cost)
    ray-1x1       `specserve serve --replicas 1`, 1 thread
    ray-2x1-pow2  `--replicas 2`, 1 thread each, Ray's power of two choices
    ray-2x1-lat   `--replicas 2`, 1 thread each, the latency-aware router with the model fitted below

First, on ray-1x1, a saturation burst (equal requests of the mix's mean length) and Poisson runs at
--fit-loads of it (lengths drawn from the mix) are fitted with `specserve latency fit`'s code. The
trace's rate is --load x one replica's saturation rate 1/C2 by that fit. The fitted model then plans
replicas for the trace (`specserve latency plan --replicas`) under a mean-E2E SLO (default: twice a lone request's mean E2E on this mix), and its per-replica prediction at 1 and 2
replicas is set beside the measured runs.

    python bench/scaleout.py [--model smollm2-135m] [--requests 100] [--out bench/results/scaleout]

About 15 minutes with the defaults on a busy 2-core machine (SmolLM2-135M, one thread per replica).

Writes OUT/runs.jsonl (+ per-request rows), OUT/model.json, OUT/trace.csv, OUT/plan.txt, OUT/summary.md and
OUT/summary.json; server logs in OUT/logs/. Prints the table. Numbers from a shared machine are noisy: say so.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from specserve.benchmark.prompts import load_tokenizer
from specserve.benchmark.results import append_run
from specserve.benchmark.runner import RunOptions, Target, run_once
from specserve.benchmark.sweep import measure_saturation
from specserve.benchmark.workload import WorkloadSpec
from specserve.latency import model_file
from specserve.latency.capacity import Slo, Traffic, per_replica, plan_capacity
from specserve.latency.capacity_report import mix_classes, render
from specserve.latency.fit import FitOptions, fit_runs
from specserve.latency.runs import load_runs
from specserve.model.registry import resolve
from specserve.scaleout.process import ReplicaServer


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


def server_args(args, replicas: int | None, router: str = "latency", model_json: Path | None = None) -> list[str]:
    common = ["--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.threads), "--speculative-config", "none",
              "--max-model-len", str(args.max_model_len), "--disable-access-log", *args.server_arg]
    if replicas is None:
        return common
    extra = ["--replicas", str(replicas), "--router", router]
    return common + extra + (["--latency-model", str(model_json)] if model_json else [])


async def measure(target: Target, spec: WorkloadSpec, opts: RunOptions, results: Path, **info) -> dict:
    record, rows = await run_once(target, spec, opts, sweep_info=info or None)
    append_run(results, record, rows)
    e2e = record["e2e_s"]
    print(f"  [{target.label}] {record['num_completed']}/{record['num_requests']} ok, achieved "
          f"{record['achieved_rate']:.3f} req/s, mean E2E {e2e['mean'] or float('nan'):.3f} s, "
          f"p99 {e2e.get('p99') or float('nan'):.3f} s", flush=True)
    return record


def fit_phase(args, server: ReplicaServer, results: Path, lengths_trace: Path, opts: RunOptions) -> tuple[float, Path]:
    """Saturation rate of one replica and a model fitted on Poisson runs below it."""
    target = Target(base_url=server.root, label="fit-1x1", k=0, server_config={"replicas": 1, "k": 0})
    # A burst of the mix itself would measure its longest request (the short ones finish, the last long one
    # runs alone): the burst is of equal requests of the mix's mean output length instead.
    mean_output = round((1 - args.long_share) * args.short + args.long_share * args.long)
    burst = WorkloadSpec(input_len=args.input_len, output_len=mean_output, dataset=args.dataset, seed=args.seed)
    sat = asyncio.run(measure_saturation(target, burst, opts, args.saturation_requests))
    print(f"  one replica saturates at {sat:.3f} req/s ({args.saturation_requests} requests of {mean_output} "
          f"tokens at once)", flush=True)
    spec = WorkloadSpec(trace=str(lengths_trace), dataset=args.dataset, seed=args.seed)
    fit_file = results.parent / "fit.jsonl"
    for i, load in enumerate(args.fit_loads):
        run = replace(spec, request_rate=load * sat, max_requests=args.fit_requests, seed=args.seed + 1 + i)
        asyncio.run(measure(target, run, opts, fit_file, load=load))
    report = fit_runs(load_runs([fit_file]), FitOptions(cross_validate=False), [str(fit_file)])
    path = results.parent / "model.json"
    model_file.save(report, path)
    c = report.model.e2e.demands(0, 1.0, report.model.output_tokens)
    print(f"  fitted: C1 {c.c1:.3f} s, C2 {c.c2:.3f} s at g={report.model.output_tokens:.0f} (saturation "
          f"{1 / c.c2:.3g} req/s); excluded {len(report.excluded)} run(s)", flush=True)
    return min(1 / c.c2, sat), path


def row(label: str, replicas: str, router: str, r: dict) -> dict:
    e2e, ttft = r["e2e_s"], r["ttft_s"]
    return {"configuration": label, "replicas x threads": replicas, "router": router,
            "offered req/s": r["offered_rate"] or r["arrival_rate"], "throughput req/s": r["request_throughput_rps"],
            "output tok/s": r["output_throughput_tps"], "mean E2E s": e2e["mean"], "p99 E2E s": e2e.get("p99"),
            "mean TTFT s": ttft["mean"], "failed": r["num_failed"]}


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    fmt = (lambda v: f"{v:.3g}" if isinstance(v, float) else ("-" if v is None else str(v)))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def planner_check(args, model_json: Path, trace: Path, runs: dict[str, dict]) -> tuple[str, dict]:
    from specserve.benchmark.arrivals import load_trace

    model = model_file.load(model_json).model
    t = load_trace(str(trace))
    rate = t.mean_rate  # what was replayed (the draw around the --load rate), as `plan --trace` reads it
    traffic = Traffic(rate, mix_classes(t.input_tokens, t.output_tokens), 1.0, f"trace {trace.name}")
    lone = per_replica(model, traffic, 1, 0, 1.0, rate=0.0).e2e
    target = args.slo_e2e_ms / 1e3 if args.slo_e2e_ms else round(2 * lone, 1)
    plan = plan_capacity(model, traffic, Slo(e2e=target), [0], max_replicas=8)
    text = render(plan, 1.0)
    predicted = {n: per_replica(model, traffic, n, 0, 1.0).e2e for n in (1, 2)}
    measured = {1: runs["ray-1x1"]["e2e_s"]["mean"],
                2: min(runs["ray-2x1-pow2"]["e2e_s"]["mean"], runs["ray-2x1-lat"]["e2e_s"]["mean"])}
    meets = [n for n in (1, 2) if measured[n] is not None and measured[n] <= target]
    check = {"slo_e2e_s": target, "lone_e2e_s": lone, "trace_rate_rps": rate, "predicted_replicas": plan.dense.replicas,
             "measured_replicas": meets[0] if meets else ">2", "predicted_e2e_s": predicted, "measured_e2e_s": measured}
    lines = [f"Planner check: mean-E2E SLO {target:g} s (twice a lone request's {lone:.3g} s unless given), "
             f"trace rate {rate:.3g} req/s.",
             "| replicas | predicted mean E2E s | measured mean E2E s (best router) | meets SLO (pred / meas) |",
             "|---|---|---|---|"]
    for n in (1, 2):
        p, m = predicted[n], measured[n]
        lines.append(f"| {n} | {p:.3g} | {'-' if m is None else f'{m:.3g}'} | "
                     f"{'yes' if p <= target else 'no'} / {'-' if m is None else ('yes' if m <= target else 'no')} |")
    lines.append(f"Planner: {check['predicted_replicas']} replica(s); measured: {check['measured_replicas']}.")
    return text, dict(check, table="\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="threads per replica (default 1)")
    p.add_argument("--dtype", default="float32",
                   help="float32 (default): CPUs without AVX512-BF16 (as the AMD EPYC this first ran on) emulate "
                        "bfloat16 at a few tokens/s")
    p.add_argument("--requests", type=int, default=100, help="requests in the trace (default 100)")
    p.add_argument("--load", type=float, default=0.7,
                   help="trace rate as a fraction of one replica's saturation 1/C2 by the fit (default 0.7)")
    p.add_argument("--fit-loads", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.2, 0.3],
                   help="fit runs' rates, fractions of the burst's rate (a skewed mix saturates well below it)")
    p.add_argument("--fit-requests", type=int, default=48)
    p.add_argument("--saturation-requests", type=int, default=64, help="burst size (default 64 = max_num_seqs)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--short", type=int, default=8, help="output tokens of most requests")
    p.add_argument("--long", type=int, default=64, help="output tokens of the few long ones")
    p.add_argument("--long-share", type=float, default=0.2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--dataset", default="spec-bench")
    p.add_argument("--slo-e2e-ms", type=float, help="the planner's mean-E2E SLO (default: 2x a lone request)")
    p.add_argument("--server-arg", action="append", default=[], help="extra `specserve serve` flag (repeat)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="shared 2-core machine: other jobs ran during the measurement",
                   help="stated with the results (e.g. 'idle machine')")
    p.add_argument("--out", default="bench/results/scaleout")
    args = p.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results, logs = out / "runs.jsonl", out / "logs"
    for old in out.glob("*.jsonl"):  # one measurement per folder: runs of an earlier one would be fitted too
        old.unlink()
    rng = np.random.default_rng(args.seed)
    lengths_trace = out / "lengths.csv"
    write_trace(lengths_trace, 1000, 1.0, args, rng)  # the mix only; fit runs draw rows from it
    model_dir = resolve(args.model)
    opts = RunOptions(progress=False, tokenizer=load_tokenizer(str(model_dir)), max_model_len=args.max_model_len)
    started = time.time()
    runs: dict[str, dict] = {}

    print("ray-1x1: saturation, fit runs, then the trace", flush=True)
    server = ReplicaServer(server_args(args, 1), logs / "ray-1x1.log")
    try:
        sat, model_json = fit_phase(args, server, results, lengths_trace, opts)
        rate = args.load * sat  # one replica at λ·C2 = --load by the fit (or of the burst's rate, if lower)
        trace = out / "trace.csv"
        write_trace(trace, args.requests, rate, args, rng)
        replay = WorkloadSpec(trace=str(trace), dataset=args.dataset, max_requests=args.requests, seed=args.seed)
        runs["ray-1x1"] = asyncio.run(measure(Target(server.root, label="ray-1x1", k=0), replay, opts, results))
    finally:
        server.stop()
    for label, replicas, router, model in (("single", None, "-", None), ("ray-2x1-pow2", 2, "pow2", None),
                                           ("ray-2x1-lat", 2, "latency", model_json)):
        print(label, flush=True)
        server = ReplicaServer(server_args(args, replicas, router, model), logs / f"{label}.log")
        try:
            if replicas:
                server.wait_healthy(replicas)
            runs[label] = asyncio.run(measure(Target(server.root, label=label, k=0), replay, opts, results))
        finally:
            server.stop()

    table = [row("single process", "1 x 1", "-", runs["single"]), row("Ray Serve", "1 x 1", "-", runs["ray-1x1"]),
             row("Ray Serve", "2 x 1", "pow2", runs["ray-2x1-pow2"]),
             row("Ray Serve", "2 x 1", "latency", runs["ray-2x1-lat"])]
    plan_text, check = planner_check(args, model_json, trace, runs)
    (out / "plan.txt").write_text(plan_text + "\n")
    mix = f"{1 - args.long_share:.0%} x {args.short} and {args.long_share:.0%} x {args.long} output tokens"
    header = (f"Model {args.model} {args.dtype}, plain decoding, {args.threads} thread(s) per replica; trace: {args.requests} "
              f"Poisson arrivals at {rate:.3g} req/s ({args.load:g} x one replica's saturation {sat:.3g} req/s: the lower of "
              f"the fit's 1/C2 and the burst's rate), "
              f"{args.input_len}-token prompts, {mix}. {args.note}. "
              f"Command: {' '.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])}; "
              f"{(time.time() - started) / 60:.1f} min.")
    summary = "\n\n".join([header, markdown(table), check.pop("table"), "```\n" + plan_text + "\n```"])
    (out / "summary.md").write_text(summary + "\n")
    (out / "summary.json").write_text(json.dumps(model_file.finite_json({
        "header": header, "rows": table, "planner": check, "saturation_rps": sat, "rate_rps": rate}), indent=1) + "\n")
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
