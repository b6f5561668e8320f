"""Closed-loop latency of our server: B requests always in flight, plain decoding against SD (issue 8).

In closed loop, Little's law turns docs/design.md §2.1's `L = C1 / (1 - λ·C2)` into `L = C1 + B·C2` (λ = B / L):
mean E2E must rise by the same C2 for every request added in flight. This script measures that rise
without arrival noise, for plain decoding and the draft at each k in --ks, and fits the line.

Each repeat launches every configuration's server in turn (the order alternates between repeats, so a
slow spell of this noisy machine does not fall on one configuration only) and runs B = each of
--concurrency, with --requests-per-slot * B + 2 requests per run. Every run draws its prompts with
the same seed, so each B's prompts begin with the smaller B's: prompts differ in how much of them the
draft gets accepted (a set with one seed per B once put a dip in acceptance, and a jump in E2E, at
B = 2), and nested sets keep that from moving with B. The table gives the median over repeats of each run's mean
E2E with the range of the repeats, and the residual of the least-squares line L = C1 + B·C2.

    python bench/closed_loop.py [--out runs/closed-loop] [--ks 4] [--concurrency 1,2,3,4] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np

from specserve.benchmark.prompts import load_tokenizer
from specserve.benchmark.results import append_run
from specserve.benchmark.runner import RunOptions, Target, run_once
from specserve.benchmark.sweep import Config, LaunchedServer
from specserve.benchmark.workload import WorkloadSpec


def configurations(args) -> list[tuple[str, int, str]]:
    """(label, k, launch command) of plain decoding and of the draft at each k."""
    serve = (f"{sys.executable} -m specserve serve --port {args.port} --num-threads {args.threads} "
             f"--max-model-len {args.max_model_len} --disable-access-log --speculative-config ")
    configs = [("no-sd", 0, serve + "none")]
    for k in args.ks:
        spec = json.dumps({"model": args.draft, "num_speculative_tokens": k}).replace(" ", "")
        configs.append((f"k{k}", k, serve + shlex.quote(spec)))
    return configs


async def measure(args, results: Path) -> list[dict]:
    opts = RunOptions(progress=False, tokenizer=load_tokenizer(args.tokenizer),
                      max_model_len=args.max_model_len)
    records = []
    configs = configurations(args)
    for repeat in range(args.repeats):
        for label, k, launch in (configs if repeat % 2 == 0 else configs[::-1]):
            target = Target(base_url=f"http://127.0.0.1:{args.port}", label=label, k=k, server_config={"k": k})
            async with LaunchedServer(Config(target, launch), results.parent / "server_logs"):
                for b in args.concurrency:
                    spec = WorkloadSpec(max_concurrency=b, max_requests=args.requests_per_slot * b + 2,
                                        input_len=args.input_len, output_len=args.output_len, seed=args.seed)
                    record, rows = await run_once(target, spec, opts,
                                                  sweep_info={"repeat": repeat, "concurrency": b})
                    append_run(str(results), record, rows)
                    records.append(record)
                    e2e = record["e2e_s"]["mean"]
                    print(f"repeat {repeat} {label} B={b}: mean E2E {e2e:.3f} s, "
                          f"{record['num_completed']} requests", flush=True)
    return records


def table(records: list[dict], concurrency: list[int]) -> str:
    by_config: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        by_config.setdefault(r["label"], {}).setdefault(r["sweep"]["concurrency"], []).append(r)
    lines = ["| config | " + " | ".join(f"B = {b}" for b in concurrency) + " | C1 (s) | C2 (s) | max |residual| |",
             "|---" * (len(concurrency) + 4) + "|"]
    for label, runs in by_config.items():
        medians = [statistics.median(r["e2e_s"]["mean"] for r in runs[b]) for b in concurrency]
        c2, c1 = np.polyfit(concurrency, medians, 1)
        residual = max(abs(m - (c1 + c2 * b)) / m for m, b in zip(medians, concurrency))
        cells = []
        for b, m in zip(concurrency, medians):
            values = [r["e2e_s"]["mean"] for r in runs[b]]
            acc = [r["spec"]["mean_acceptance_length"] for r in runs[b] if r["spec"]["mean_acceptance_length"]]
            cell = f"{m:.2f} ({min(values):.2f}-{max(values):.2f})"
            cells.append(cell + (f" E {statistics.median(acc):.2f}" if acc else ""))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {c1:.2f} | {c2:.2f} | {100 * residual:.1f} % |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--out", default="runs/closed-loop")
    p.add_argument("--ks", type=ints, default=[4])
    p.add_argument("--draft", default="default")
    p.add_argument("--concurrency", type=ints, default=[1, 2, 3, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests-per-slot", type=int, default=6)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="prompt draw, the same for every run")
    p.add_argument("--threads", type=int, default=1, help="server torch threads (leave a core for the client)")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    from specserve.model.registry import fetch
    args.tokenizer = str(fetch("smollm2-135m"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "closed.jsonl"
    records = asyncio.run(measure(args, results))
    print(f"\nappended {len(records)} runs to {results}; median of {args.repeats} repeats (range), "
          f"E = acceptance length:\n")
    print(table(records, args.concurrency))


if __name__ == "__main__":
    main()
