"""The `specserve serve` flags of scale-out. Argparse only: `specserve --help` must stay fast."""
from __future__ import annotations

import argparse


def add_scaleout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (pip install 'specserve[scaleout]'; docs/scaleout.md)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="run N engine replicas as Ray Serve deployments behind this one endpoint, each with "
                        "--num-threads threads (default: one engine in this process, no Ray)")
    g.add_argument("--router", choices=("pow2", "latency"), default="pow2",
                   help="pow2: Ray's power of two choices; latency: the replica with the lowest predicted latency "
                        "for this request (its fitted coefficients, in-flight requests and the request's "
                        "lengths) (default pow2)")
    g.add_argument("--front", choices=("process", "ray"), default="process",
                   help="who answers HTTP: process (this process, calling the replicas through a Ray handle: "
                        "one hop) or ray (Ray Serve's HTTP proxy and an ingress deployment: two hops, what a "
                        "Serve config file deploys) (default process)")
    g.add_argument("--latency-model", metavar="MODEL.json", default=None,
                   help="fitted coefficients (`specserve latency fit`) for --router latency "
                        "(default: none; it then balances in-flight work by length)")
    g.add_argument("--session-field", default=None, metavar="FIELDS",
                   help="request fields that keep a chat on one replica, comma separated, 'none' to turn off "
                        "(default: session_id,user)")
    g.add_argument("--max-retries", type=int, default=2,
                   help="times a request that has sent nothing yet is retried on another replica when its "
                        "replica dies or is full (default 2)")
    g.add_argument("--gpus-per-replica", type=float, default=0.0,
                   help="GPUs Ray reserves for each replica (default 0: CPU replicas)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. 'auto') instead of starting a local one")
