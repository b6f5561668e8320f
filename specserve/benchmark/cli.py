"""`specserve bench`, `specserve bench sweep`, `specserve bench report`. Argparse only at import time."""
from __future__ import annotations

import argparse
import json

from specserve.settings import settings

RUN_HELP = "benchmark an OpenAI-compatible server (trace replay, Poisson/Gamma, closed loop)"
DEFAULT_RESULTS = "bench_results.jsonl"


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive (inf sends everything at once)")
    return value


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError("expected positive numbers")
    return values


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", help="model name to send (default: the first one /v1/models lists)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--api-key", default=settings.openai_api_key,
                   help="bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--label", default="default", help="name of this server configuration in the results")
    g.add_argument("--k", type=int, help="its speculation length (0 = no speculative decoding)")
    g.add_argument("--server-config", type=_json_object, default={},
                   help="JSON object describing the configuration, stored with the results")
    g = p.add_argument_group("arrivals")
    g.add_argument("--trace", help="trace file (Azure CSV, Mooncake JSONL, one-column timestamps) or "
                                   "'azure-conv' (shipped; the default arrival process)")
    g.add_argument("--trace-format", choices=("auto", "azure", "mooncake", "timestamps"), default="auto",
                   help="'timestamps' uses only the arrival times of a trace of any format (not its "
                        "lengths or prefix blocks); 'auto' detects the format from the file")
    g.add_argument("--time-scale", type=_rate, default=1.0,
                   help="multiply trace inter-arrival times (0.5 = twice as fast)")
    g.add_argument("--start", type=float, default=0.0, help="seconds into the trace where the window starts")
    g.add_argument("--duration", type=float,
                   help="seconds of trace to replay (default 60), or of synthetic arrivals")
    g.add_argument("--max-requests", "--num-prompts", type=int, dest="max_requests",
                   help="at most this many requests (default 100 for synthetic and closed loop)")
    g.add_argument("--request-rate", type=_rate,
                   help="synthetic arrivals at this mean rate (req/s); 'inf' sends all at once")
    g.add_argument("--burstiness", type=_rate, default=1.0,
                   help="coefficient of variation of inter-arrival gaps: 1 Poisson, >1 burstier (Gamma)")
    g.add_argument("--max-concurrency", type=int,
                   help="at most N requests in flight; without a rate or trace: a closed loop")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset", default="spec-bench",
                   help="spec-bench, mt-bench, sharegpt, sharegpt-500, python-stdlib (code), code-edit "
                        "(with --turns: multi-turn code editing sessions), random, or a .jsonl/.json file")
    g.add_argument("--input-len", type=int, help="prompt tokens per request (overrides trace lengths)")
    g.add_argument("--output-len", type=int, help="output tokens per request (default: trace, else 128)")
    g.add_argument("--tokenizer", help="tokenizer.json or model folder, for prompts of exact token length")
    g.add_argument("--max-model-len", type=int, help="clip prompt+output to this (default: from /v1/models)")
    g.add_argument("--turns", type=int,
                   help="multi-turn conversations of this many turns (MT-Bench, or code-edit sessions with "
                        "--dataset code-edit; chat endpoint): each turn sends the history, the model's own "
                        "replies included; arrivals start conversations")
    g.add_argument("--think-time", type=float, default=0.0, metavar="SECONDS",
                   help="with --turns: pause between a reply's end and the next turn (default: 0)")
    g = p.add_argument_group("requests and run")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let the model stop early instead of forcing the output length")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--extra-body", type=_json_object, help="JSON merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--warmup-requests", type=int, default=2, help="sent before the run, not measured")
    g.add_argument("--discard-first", type=float, default=0.0, metavar="SECONDS",
                   help="exclude requests arriving in the first SECONDS (queue fill-up) from the metrics")
    g.add_argument("--slo", help="SLO bounds in ms, e.g. 'ttft:500 tpot:50 e2e:10000'")
    g.add_argument("--results", default=DEFAULT_RESULTS, help="results JSONL to append to")
    g.add_argument("--no-progress", action="store_true")


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help=RUN_HELP, description=RUN_HELP + ". Sub-forms: "
                              "'bench sweep' (many rates and configurations), 'bench report' (plots).",
                              epilog="example: specserve bench --base-url http://127.0.0.1:8000 --request-rate 2 "
                                     "--max-requests 50 --input-len 256 --output-len 128 --slo 'ttft:2000 tpot:200'")
    add_run_args(p)
    p.set_defaults(func=_run)
    sub = p.add_subparsers(dest="bench_command", metavar="{sweep,report}")
    s = sub.add_parser("sweep", help="every configuration at every rate, into one results file",
                       description="Run every configuration at every rate; append one line per run.",
                       epilog="example: specserve bench sweep --configs sweep.json --fractions 0.25,0.5,0.75 "
                              "--input-len 256 --output-len 64 --duration 40 --results runs/sweep.jsonl "
                              "(docs/bench.md#sweeps)")
    add_run_args(s)
    g = s.add_argument_group("sweep")
    rates = g.add_mutually_exclusive_group(required=True)
    rates.add_argument("--rates", type=_floats, help="request rates, e.g. 0.5,1,2,4")
    rates.add_argument("--fractions", type=_floats,
                       help="fractions of a saturation rate measured first, e.g. 0.2,0.4,0.6,0.8")
    g.add_argument("--config", action="append", default=[], metavar="LABEL=URL[,k=N][,model=M]",
                   help="a server configuration (repeat for several)")
    g.add_argument("--configs", metavar="FILE.json",
                   help="JSON list of {label, base_url, model, k, server_config, launch}")
    g.add_argument("--saturation-requests", type=int, default=64,
                   help="burst size used to measure the saturation rate")
    g.add_argument("--per-config-saturation", action="store_true",
                   help="measure saturation per configuration (default: the first one's, for all)")
    g.add_argument("--scale-trace", action="store_true",
                   help="replay the trace time-scaled to each rate instead of Poisson/Gamma arrivals")
    g.add_argument("--interleave", action="store_true",
                   help="start every server first, then run rounds of every configuration at shuffled rates "
                        "(--seed), so drift of the machine's speed does not offset one configuration")
    g.add_argument("--probe", type=int, default=0, metavar="N",
                   help="with --interleave: N lone requests to the first configuration before and after every "
                        "run, appended to RESULTS.probes.jsonl (the machine's speed through the sweep)")
    g.add_argument("--log-dir", default="bench_server_logs", help="logs of servers started by 'launch'")
    g.add_argument("--report", metavar="DIR", help="also write the report into DIR at the end")
    s.set_defaults(func=_sweep)
    r = sub.add_parser("report", help="PNG plots and an HTML page from a results file")
    r.add_argument("results", help="results JSONL written by specserve bench")
    r.add_argument("--out", help="output folder (default: RESULTS stem + '_report')")
    r.set_defaults(func=_report)


def _common(args):
    """Target, workload and run options from the shared flags."""
    from specserve.benchmark.metrics import parse_slo
    from specserve.benchmark.prompts import load_tokenizer
    from specserve.benchmark.runner import RunOptions, Target
    from specserve.benchmark.workload import WorkloadSpec
    from specserve.errors import SpecServeError

    for name in ("max_requests", "max_concurrency", "input_len", "output_len", "max_model_len"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SpecServeError(f"--{name.replace('_', '-')} must be at least 1")
    if args.k is not None and args.k < 0:
        raise SpecServeError("--k must be 0 (no speculative decoding) or more")
    if args.duration is not None and args.duration <= 0:
        raise SpecServeError("--duration must be positive")
    if args.turns is not None and args.turns < 1:
        raise SpecServeError("--turns must be at least 1")
    if args.think_time < 0:
        raise SpecServeError("--think-time must not be negative")
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise SpecServeError(str(e)) from None
    target = Target(base_url=args.base_url or "", model=args.model, label=args.label, k=args.k,
                    server_config=dict(args.server_config, **({"k": args.k} if args.k is not None else {})),
                    endpoint="chat" if args.turns else args.endpoint, api_key=args.api_key)
    spec = WorkloadSpec(trace=args.trace, trace_format=args.trace_format, time_scale=args.time_scale,
                        start_s=args.start, duration_s=args.duration, max_requests=args.max_requests,
                        request_rate=args.request_rate, burstiness=args.burstiness,
                        max_concurrency=args.max_concurrency, dataset=args.dataset,
                        input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                        turns=args.turns, think_time_s=args.think_time)
    opts = RunOptions(warmup_requests=args.warmup_requests, discard_first_s=args.discard_first, slo=slo,
                      ignore_eos=not args.no_ignore_eos, temperature=args.temperature,
                      extra_body=args.extra_body, request_timeout_s=args.request_timeout,
                      progress=not args.no_progress, tokenizer=load_tokenizer(args.tokenizer),
                      max_model_len=args.max_model_len)
    return target, spec, opts


def _run(args) -> int:
    import asyncio

    from specserve.benchmark.results import append_run
    from specserve.benchmark.runner import run_once
    from specserve.benchmark.table import print_run
    from specserve.errors import SpecServeError

    if not args.base_url:
        raise SpecServeError("--base-url is required (e.g. http://127.0.0.1:8000)")
    target, spec, opts = _common(args)
    record, rows = asyncio.run(run_once(target, spec, opts))
    append_run(args.results, record, rows)
    print_run(record)
    print(f"appended run {record['run_id']} to {args.results}")
    return 0 if record["num_completed"] else 1


def _sweep(args) -> int:
    import asyncio
    from pathlib import Path

    from specserve.benchmark.sweep import Config, SweepPlan, load_config_file, parse_config_arg, run_sweep
    from specserve.benchmark.table import print_sweep
    from specserve.errors import SpecServeError

    target, spec, opts = _common(args)
    configs = [parse_config_arg(c, target) for c in args.config]
    if args.configs:
        configs += load_config_file(args.configs, target)
    if not configs:
        if not args.base_url:
            raise SpecServeError("give --base-url, --config LABEL=URL or --configs FILE.json")
        configs = [Config(target)]
    plan = SweepPlan(configs, rates=args.rates, fractions=args.fractions,
                     saturation_requests=args.saturation_requests,
                     per_config_saturation=args.per_config_saturation, scale_trace=args.scale_trace,
                     log_dir=Path(args.log_dir), interleave=args.interleave, seed=args.seed,
                     probe_requests=args.probe)

    def line(r):
        e2e = r["e2e_s"]["mean"]
        print(f"[{r['label']}] offered {r.get('offered_rate') or 0:.3f} req/s -> achieved "
              f"{r['achieved_rate']:.3f}, mean E2E {'-' if e2e is None else f'{e2e:.3f}s'}, "
              f"{r['num_failed']} failed", flush=True)

    records = asyncio.run(run_sweep(plan, spec, opts, args.results, on_record=line))
    print_sweep(records)
    print(f"appended {len(records)} runs to {args.results}")
    if args.report:
        from specserve.benchmark.report import write_report

        print(f"report: {write_report(args.results, args.report)}")
    return 0 if all(r["num_completed"] for r in records) else 1


def _report(args) -> int:
    from specserve.benchmark.report import write_report

    path = write_report(args.results, args.out)
    print(f"wrote {path} and its PNGs")
    return 0
