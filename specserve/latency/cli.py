"""`specserve latency fit | predict | plan | explain | plot | validate` — argument definitions only.

The handlers live in `specserve.latency.commands` and are imported when a subcommand runs, so that
`specserve --help` does not pay for numpy, scipy and matplotlib.
"""
from __future__ import annotations

import argparse
import importlib


def _handler(name: str):
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module("specserve.latency.commands"), name)(args)
    return run


def _results(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("results", nargs="+", help=help)
    p.add_argument("--k", action="append", default=[], metavar="LABEL=K",
                   help="speculation length of a configuration whose records do not say it")
    p.add_argument("--alpha", action="append", default=[], metavar="LABEL=A",
                   help="i.i.d. acceptance of a configuration without speculation stats (overrides them)")


def _fit_options(p: argparse.ArgumentParser) -> None:
    _results(p, "results JSONL files written by `specserve bench`")
    p.add_argument("--moe", metavar="ACTIVE/EXPERTS", help="fit the MoE coverage correction, e.g. 8/128")
    p.add_argument("--rate-tolerance", type=float, default=0.10,
                   help="exclude runs whose achieved rate falls this fraction short of offered (default 0.10)")
    p.add_argument("--growth-tolerance", type=float, default=1.0,
                   help="exclude runs whose in-flight count grew by this fraction of its mean (default 1.0)")
    p.add_argument("--length-classes", type=int, default=4, help="length classes for mixed traffic (default 4)")
    p.add_argument("--no-prefill-prior", action="store_true",
                   help="fit c2p freely instead of drawing it towards a lone request's TTFT")
    p.add_argument("--no-draft-floor", action="store_true",
                   help="fit c2d freely instead of at least c2v (a drafted token's load at least a verify cycle's)")
    p.add_argument("--slots", type=int, metavar="N",
                   help="the server runs at most N requests at once and queues the rest (llama-server's -np, "
                        "a --max-num-seqs the load reaches); default: no cap")
    p.add_argument("--assume-poisson", action="store_true",
                   help="take every run's arrivals as Poisson (load = rate*L, docs/design.md §2.1) even where the "
                        "records state a more regular or burstier process")


def _arrival_cv(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arrival-cv", type=float,
                   help="coefficient of variation of the arrival gaps to predict for (1 = Poisson; "
                        "default: the fitted runs')")


def _extrapolate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--extrapolate", action="store_true",
                   help="also rank k outside the measured range (their costs and acceptance extrapolated)")


def register(subparsers) -> None:
    latency = subparsers.add_parser("latency", help="fit, predict, plan and explain SD latency under load",
                                    description="The interpretable latency model (docs/design.md §2): fit "
                                                "L = C1/(1 - rate*C2) with six SD coefficients to a bench sweep "
                                                "of any server, then predict, plan k, explain and validate.",
                                    epilog="example: specserve latency fit bench/results/latency20/fixed.jsonl "
                                           "-o model.json && specserve latency explain model.json")
    sub = latency.add_subparsers(dest="latency_command", required=True)

    p = sub.add_parser("fit", help="fit a model from bench results")
    _fit_options(p)
    p.add_argument("-o", "--output", required=True, help="model.json to write")
    p.add_argument("--no-cross-validation", action="store_true", help="skip leave-one-out refits (faster)")
    p.set_defaults(func=_handler("fit"))

    p = sub.add_parser("predict", help="latency, TTFT, TPOT and tails at one rate and k")
    p.add_argument("model")
    p.add_argument("--rate", type=float, required=True, help="request rate (req/s)")
    p.add_argument("--k", type=int, default=0, help="speculation length (0 = no SD)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--alpha", type=float, help="i.i.d. per-token acceptance in (0, 1]")
    group.add_argument("--alphas", help="per-position acceptance a1,a2,... (position-dependent)")
    p.add_argument("--output-tokens", type=float, help="mean generated tokens (default: the fitted runs')")
    p.add_argument("--prompt-tokens", type=float, help="mean prompt tokens (default: the fitted runs')")
    p.add_argument("--lengths", help="per-request rows (JSONL) or a CSV trace: predict its length classes")
    _arrival_cv(p)
    p.add_argument("--trace", help="a trace (Azure CSV, Mooncake JSONL, timestamps) whose arrivals' rate drift the "
                                   "mean E2E is also averaged over, and whose fast gaps' CV it predicts for")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_handler("predict"))

    p = sub.add_parser("plan", help="best k per rate, break-even rates, most load under an SLO; with "
                       "--replicas, how many replicas an SLO needs",
                       epilog="example: specserve latency plan model.json --replicas --trace runs/trace.csv "
                              "--slo-e2e-ms 4000 --slo-ttft-ms 500   (docs/scaleout.md#capacity-planning)")
    p.add_argument("model")
    p.add_argument("--rates", nargs="+", help="request rates, space or comma separated (with --replicas: the "
                                              "total offered to the deployment; default: --trace's)")
    p.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="candidate k (default 0..8)")
    p.add_argument("--alpha", type=float, help="i.i.d. acceptance (default: measured per k, else median)")
    p.add_argument("--slo-e2e-ms", type=float, help="mean end-to-end latency target (ms)")
    _extrapolate(p)
    p.add_argument("--draws", type=int, default=400,
                   help="coefficient draws from the fit's uncertainty for each choice of k (0: none; default 400)")
    p.add_argument("--seed", type=int, default=0, help="seed of those draws")
    _arrival_cv(p)
    g = p.add_argument_group("capacity (--replicas)")
    g.add_argument("--replicas", type=int, nargs="?", const=64, default=None, metavar="MAX",
                   help="plan replicas instead: the fewest (up to MAX, default 64) that meet every given SLO, "
                        "with and without speculation, and the break-even load per replica")
    g.add_argument("--slo-ttft-ms", type=float, help="time-to-first-token target (ms)")
    g.add_argument("--slo-tpot-ms", type=float, help="time-per-output-token target (ms)")
    g.add_argument("--slo-stat", choices=("mean", "p95", "p99"), default="mean",
                   help="what the SLOs bound (default mean; p95/p99 need a fit with tails)")
    g.add_argument("--trace", help="the traffic: a trace (Azure CSV, Mooncake JSONL, timestamps) whose arrivals "
                                   "give the rate and whose token columns give the length mix")
    g.add_argument("--time-scale", type=float, default=1.0, help="multiply the trace's gaps (0.5 = twice the rate)")
    g.add_argument("--lengths", help="the length mix from bench per-request rows (JSONL) or a CSV")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_handler("plan_command"))

    p = sub.add_parser("explain", help="plain-language report of a fitted model")
    p.add_argument("model")
    p.add_argument("--ks", default="0,1,2,3,4,5,6,7,8", help="candidate k for the best-k bands")
    p.add_argument("--alpha", type=float, help="i.i.d. acceptance for the best-k bands")
    _extrapolate(p)
    p.set_defaults(func=_handler("explain"))

    p = sub.add_parser("plot", help="collapse, latency-vs-rate and speedup-vs-load PNGs")
    p.add_argument("model")
    _results(p, "the results the model was fitted on (measured points)")
    p.add_argument("-o", "--out-dir", default="latency-plots", help="folder for the PNGs")
    p.set_defaults(func=_handler("plot"))

    p = sub.add_parser("validate", help="held-out rate and held-out k errors (MAPE tables)")
    _fit_options(p)
    p.add_argument("--markdown", help="also write the tables as Markdown to this file")
    p.add_argument("--json", action="store_true", help="print the cross-validation results as JSON instead")
    p.set_defaults(func=_handler("validate"))
