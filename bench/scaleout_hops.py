"""What each hop of the scale-out path costs one request (issue 63): lone requests, no load.

The same streamed completion (a 64-token prompt, 8 tokens) is sent one at a time to `specserve serve`
(one process), to one Ray replica whose serving process answers HTTP itself (`--front process`: client ->
process -> replica, one Ray hop) and to one behind Ray Serve's proxy and ingress deployment (`--front ray`:
client -> proxy -> ingress -> replica, two Ray hops). The differences of the medians are what the hops
add to the time to first token and to the whole request; --repeats rounds, servers in a rotated order.

    python bench/scaleout_hops.py [--requests 20] [--repeats 3] [--out bench/results/scaleout/hops.md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from scaleout import CONFIGS  # noqa: E402 - the same servers as bench/scaleout.py

from specserve.benchmark.machine import cpu_name  # noqa: E402
from specserve.scaleout.process import ReplicaServer  # noqa: E402

LABELS = ("single", "ray-1x1", "ray-1x1-proxy")
PROMPT = "Tell me about the history of the city of Rome, its emperors and its buildings. " * 4  # ~64 tokens


def lone_requests(root: str, model: str, n: int) -> tuple[list[float], list[float]]:
    """(TTFT, E2E) in ms of n streamed requests sent one after another (the first two warm up)."""
    ttft, e2e = [], []
    with httpx.Client(timeout=60) as client:
        for i in range(n + 2):
            start = time.perf_counter()
            first = None
            with client.stream("POST", root + "/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "stream": True}) as r:
                if r.status_code != 200:
                    raise SystemExit(f"{root}: {r.status_code} {r.read().decode()[:200]}")
                for line in r.iter_lines():
                    if first is None and line.startswith("data:"):
                        first = time.perf_counter() - start
            if i >= 2:
                ttft.append(1e3 * first)
                e2e.append(1e3 * (time.perf_counter() - start))
    return ttft, e2e


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="bench/results/scaleout/hops.md")
    args = p.parse_args()
    flags = ["--model", args.model, "--dtype", "float32", "--num-threads", "1", "--speculative-config", "none",
             "--max-model-len", "1024", "--disable-access-log"]
    out = Path(args.out)
    medians: dict[str, list[tuple[float, float]]] = {label: [] for label in LABELS}
    for rep in range(args.repeats):
        for label in LABELS[rep % 3:] + LABELS[:rep % 3]:
            replicas, extra, _ = CONFIGS[label]
            server = ReplicaServer(flags + ([] if replicas is None else ["--replicas", "1", *extra]),
                                   out.parent / "logs" / f"hops-{label}-{rep + 1}.log")
            try:
                if replicas:
                    server.wait_healthy(1)
                ttft, e2e = lone_requests(server.root, args.model, args.requests)
            finally:
                server.stop()
            medians[label].append((statistics.median(ttft), statistics.median(e2e)))
            print(f"  {label} round {rep + 1}: TTFT {medians[label][-1][0]:.1f} ms, E2E {medians[label][-1][1]:.1f} ms",
                  flush=True)

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"

    base = medians["single"]
    lines = [f"Lone streamed requests (64-token prompt, 8 tokens), {args.requests} per round after 2 warm-up, "
             f"{args.repeats} rounds; CPU {cpu_name()}. Command: python bench/scaleout_hops.py "
             + " ".join(sys.argv[1:]), "",
             "| path | TTFT ms, median of rounds [range] | E2E ms | TTFT added vs one process | E2E added |",
             "|---|---|---|---|---|"]
    for label, path in zip(LABELS, ("one process (no Ray)", "client -> process -> replica (--front process)",
                                    "client -> proxy -> ingress -> replica (--front ray)")):
        m = medians[label]
        lines.append(f"| {path} | {cell([t for t, _ in m])} | {cell([e for _, e in m])} | "
                     f"{cell([t - b for (t, _), (b, _) in zip(m, base)])} | "
                     f"{cell([e - b for (_, e), (_, b) in zip(m, base)])} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
