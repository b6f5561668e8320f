"""Issue 8 validation: sweep our own server, fit the latency model, predict held-out rates and k.

For each workload it launches `specserve serve` once per configuration (no SD, and the draft model with
k in --ks), replays arrivals at --fractions of each configuration's own measured saturation rate (a
draft that accepts little saturates the server well before plain decoding does), appends every
run to one results file, and prints `specserve latency validate` tables (fit on all but one rate / one
k, predict the held-out ones; MAPE of mean E2E, TTFT, TPOT and E2E p95/p99).

Workloads: `fixed` (256-token prompts, 128-token outputs) and `azure` (the Azure conversation trace's
lengths, each request's from a random row of the whole trace, prompts clipped to --max-model-len; its
lengths only: arrivals are the same Gamma process as `fixed`'s, see below).

Each run must reach a steady state before it is measured: on a 2-core CPU a 128-token request takes
10-15 s end to end, so the in-flight count ramps up for that long after the run starts, and a run
measured from its first request looks like a growing queue (the fitter then excludes it as saturated).
Hence the defaults: 90 s of arrivals per run, the first 25 s sent but not measured; with the drain,
each run takes about 2 minutes, so 5 configurations x 8 rates take over an hour per workload there.

Arrivals are regular by default (Gamma gaps with CV --burstiness 0.25, not Poisson's 1): in a run of a
few dozen requests Poisson burstiness alone moves a high-load run's mean E2E by tens of percent, which is
measurement noise, not model error. The results record the CV and the fit counts the company such
arrivals give a request (docs/latency.md, Arrival regularity). `--burstiness 1` gives Poisson arrivals.
`--interleave` starts all five servers first and runs rounds of every configuration, each at a rate from
its own shuffled list, instead of one ~18-minute block per configuration: the machine's speed drifts by
several percent over an hour, and in blocks that drift offsets whole configurations (docs/latency.md).
Running the same command into several --out folders and validating their results files together
(`specserve latency validate A/fixed.jsonl B/fixed.jsonl ...`) treats them as repeats: each held-out
point is also scored at the average of its repeats, beside the repeats' own scatter.

    python bench/latency_validation.py [--out runs/latency] [--workloads fixed,azure] [--ks 1,2,4,6] [--interleave]
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path


def specserve(*args: str) -> None:
    cmd = [sys.executable, "-m", "specserve", *args]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/latency")
    p.add_argument("--workloads", default="fixed,azure")
    p.add_argument("--ks", default="1,2,4,6")
    p.add_argument("--draft", default="default")
    p.add_argument("--fractions", default="0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8")
    p.add_argument("--requests-per-run", type=int, default=200)
    p.add_argument("--duration", type=float, default=90.0, help="wall seconds of arrivals per run")
    p.add_argument("--burstiness", type=float, default=0.25,
                   help="coefficient of variation of inter-arrival gaps (1 = Poisson)")
    p.add_argument("--discard-first", type=float, default=25.0,
                   help="seconds of each run sent but not measured (ramp-up to the steady state)")
    # One torch thread: the server's HTTP event loop and the load generator need the other core. With
    # two torch threads on two cores every SSE chunk preempts a matmul thread and step times jitter
    # (torch's threads stall while one is descheduled), which swamps the load signal.
    p.add_argument("--threads", type=int, default=1, help="server torch threads (leave a core for the rest)")
    p.add_argument("--interleave", action="store_true",
                   help="all servers up at once, rounds of every configuration at shuffled rates")
    p.add_argument("--probe", type=int, default=0, metavar="N",
                   help="with --interleave: N lone no-SD requests before and after every run (machine speed)")
    p.add_argument("--port", type=int, default=8123, help="the first configuration's port; the next ones count up")
    p.add_argument("--max-model-len", type=int, default=1024)
    # A repeat with its own seed draws its own arrival schedule: repeats of one seed replay the same
    # collisions between prefills, so their TTFTs agree with each other and not with the model.
    p.add_argument("--seed", type=int, default=0, help="arrival schedule seed (give each repeat its own)")
    # Every run replays prompts from one seeded list, so with the prefix cache on a run's TTFT depends on what
    # the runs before it left cached: a long run cycles more prompts through the cache than it holds, and
    # the next run then misses on nearly all of them (docs/experiments/latency-validation.md, latency22).
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="serve with --no-enable-prefix-caching: every prefill cold, whatever ran before")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from specserve.model.registry import fetch
    tokenizer = str(fetch("smollm2-135m"))
    serve = (f"{sys.executable} -m specserve serve --num-threads {args.threads} "
             f"--max-model-len {args.max_model_len} --disable-access-log"
             + (" --no-enable-prefix-caching" if args.no_prefix_caching else ""))
    configs = [{"label": "no-sd", "k": 0, "launch": f"{serve} --speculative-config none"}]
    for k in [int(x) for x in args.ks.split(",")]:
        spec = json.dumps({"model": args.draft, "num_speculative_tokens": k}).replace(" ", "")
        configs.append({"label": f"k{k}", "k": k, "launch": f"{serve} --speculative-config {shlex.quote(spec)}"})
    for n, c in enumerate(configs):
        c["base_url"] = f"http://127.0.0.1:{args.port + n}"
        c["launch"] += f" --port {args.port + n}"
    config_file = out / "configs.json"
    config_file.write_text(json.dumps(configs, indent=2))
    for workload in args.workloads.split(","):
        results = out / f"{workload}.jsonl"
        lengths = (["--input-len", "256", "--output-len", "128"] if workload == "fixed"
                   else ["--trace", "azure-conv", "--max-model-len", str(args.max_model_len)])
        specserve("bench", "sweep", "--configs", str(config_file), "--fractions", args.fractions,
                  "--per-config-saturation", "--max-requests", str(args.requests_per_run),
                  "--duration", str(args.duration),
                  "--discard-first", str(args.discard_first), "--burstiness", str(args.burstiness),
                  "--seed", str(args.seed),
                  "--tokenizer", tokenizer, "--no-progress",
                  "--results", str(results), "--log-dir", str(out / "server_logs"), *lengths,
                  *(["--interleave"] if args.interleave else []), "--probe", str(args.probe))
        table = out / f"{workload}_validation.md"
        specserve("latency", "validate", str(results), "--markdown", str(table))
        print(table.read_text())


if __name__ == "__main__":
    main()
