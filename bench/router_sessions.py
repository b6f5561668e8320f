"""The routers on a session mix (issue 81 item 4): latency-aware against power of two, 2 replicas.

Multi-turn code-editing conversations (`specserve bench --turns`, data set code-edit: each session carries
one function and asks an edit per turn, so every turn re-sends a long shared prefix) start at Poisson
arrivals; every turn names its conversation (OpenAI's `user`), which both routers read as the session and
keep on one replica while it is no more than --session-imbalance requests busier than the other. Prefix
caching is on, so where a turn lands decides whether its history is recomputed. Each repeat starts each
router afresh (order rotated every repeat), warms it with one short run, then replays the same
conversations at each --rates (conversation starts per second).

    python bench/router_sessions.py [--rates 0.4,0.8] [--repeats 2] [--turns 4] [--conversations 24]
        [--latency-model bench/results/scaleout/model.json] [--out bench/results/router_sessions/NAME]

Writes OUT/runs.jsonl (+ per-request rows), OUT/summary.md, OUT/summary.json and server logs in OUT/logs/.
Benchmark on an idle machine: two replicas share its cores with Ray and the front.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

from specserve.benchmark.machine import cpu_name, git_commit
from specserve.benchmark.results import append_run
from specserve.benchmark.runner import RunOptions, Target, run_once
from specserve.benchmark.workload import WorkloadSpec
from specserve.scaleout.process import ReplicaServer

ROUTERS = ("pow2", "latency")


def server_args(args, router: str) -> list[str]:
    out = ["--model", args.model, "--dtype", args.dtype, "--num-threads", "1", "--speculative-config", "none",
           "--max-model-len", str(args.max_model_len), "--disable-access-log", "--replicas", "2", "--router", router]
    return out + (["--latency-model", args.latency_model] if router == "latency" else [])


def spec(args, rate: float, seed: int, conversations: int) -> WorkloadSpec:
    return WorkloadSpec(request_rate=rate, max_requests=conversations, dataset="code-edit", turns=args.turns,
                        think_time_s=args.think_time, output_len=args.output_len, seed=seed)


def run(args, router: str, repeat: int, out: Path, opts: RunOptions) -> list[dict]:
    server = ReplicaServer(server_args(args, router), out / "logs" / f"{router}-r{repeat}.log")
    records = []
    try:
        target = Target(base_url=server.root, label=router, endpoint="chat",
                        server_config={"replicas": 2, "router": router})
        asyncio.run(run_once(target, spec(args, args.rates[0], 999, 4), opts))  # warm-up, not kept
        for i, rate in enumerate(args.rates):
            record, rows = asyncio.run(run_once(target, spec(args, rate, args.seed + i, args.conversations), opts,
                                                sweep_info={"repeat": repeat, "rate": rate}))
            append_run(out / "runs.jsonl", record, rows)
            hit = record.get("prefix_cache_hit_rate")
            print(f"  [{router} r{repeat}] {rate:g} conv/s: {record['num_completed']}/{record['num_requests']} ok, "
                  f"mean E2E {record['e2e_s']['mean']:.3f} s, TTFT {record['ttft_s']['mean']:.3f} s, prefix hits "
                  f"{'-' if hit is None else f'{hit:.0%}'}", flush=True)
            records.append(record)
    finally:
        server.stop()
    return records


def summarize(args, records: list[dict], minutes: float) -> tuple[str, dict]:
    def cell(router, rate, key):
        return [r[key]["mean"] if isinstance(r[key], dict) else r[key] for r in records
                if r["label"] == router and r["sweep"]["rate"] == rate]

    def fmt(values):
        v = [x for x in values if x is not None]
        return "-" if not v else f"{np.median(v):.3g} [{min(v):.3g}-{max(v):.3g}]"

    lines = [f"`python bench/router_sessions.py {' '.join(args.argv)}`", "",
             f"Machine: {cpu_name()}; commit {git_commit()}; {args.note}; {minutes:.1f} min. Model {args.model} "
             f"{args.dtype}, 2 replicas x 1 thread, prefix caching on, no speculation; latency model "
             f"{args.latency_model}. {args.conversations} code-edit conversations of {args.turns} turns per run, "
             f"{args.output_len} output tokens a turn, think time {args.think_time:g} s.", "",
             "| rate conv/s | router | mean E2E s | mean TTFT s | prefix-cache hit rate |", "|---|---|---|---|---|"]
    ratios = {}
    for rate in args.rates:
        for router in ROUTERS:
            lines.append(f"| {rate:g} | {router} | {fmt(cell(router, rate, 'e2e_s'))} | "
                         f"{fmt(cell(router, rate, 'ttft_s'))} | {fmt(cell(router, rate, 'prefix_cache_hit_rate'))} |")
        pairs = list(zip(cell("latency", rate, "e2e_s"), cell("pow2", rate, "e2e_s")))
        ratios[rate] = [a / b for a, b in pairs]
    lines += ["", "| ratio latency / pow2, mean E2E (paired per repeat) | " + " | ".join(f"{r:g} conv/s" for r in args.rates)
              + " |", "|---|" + "---|" * len(args.rates),
              "| median [range] | " + " | ".join(fmt(ratios[r]) for r in args.rates) + " |"]
    return "\n".join(lines) + "\n", {"ratios": {str(k): v for k, v in ratios.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.4, 0.8])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--conversations", type=int, default=24, help="conversations per run")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--think-time", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--latency-model", default="bench/results/scaleout/model.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--note", default="idle machine")
    p.add_argument("--out", default="bench/results/router_sessions/latest")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = RunOptions(progress=False)
    start, records = time.monotonic(), []
    for repeat in range(args.repeats):
        order = ROUTERS[repeat % 2:] + ROUTERS[:repeat % 2]
        for router in order:
            records += run(args, router, repeat, out, opts)
    text, data = summarize(args, records, (time.monotonic() - start) / 60)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
