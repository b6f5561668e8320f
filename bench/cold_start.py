"""Seconds from `specserve serve` to a healthy server, with warm caches, for one or more source trees.

Each tree (a checkout of specserve; default: this one) runs the same command with PYTHONPATH at the tree,
once untimed (its caches: kernels built, the step-cost profile, the GGUF index), then --repeats times,
the trees interleaved round by round. The engine's own phase log lines (startup: ..., ready: ...) of the
last run of each tree are kept beside the times.

    python bench/cold_start.py [--trees /path/a,/path/b] [--repeats 3] [--args "--speculative-config none"]
        [--label NAME]

Prints a table and writes bench/results/cold_start/<label>.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from specserve.benchmark.machine import cpu_name

RESULTS = Path(__file__).parent / "results" / "cold_start"


def ready_seconds(tree: Path, port: int, extra: list[str], log: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--port", str(port), *extra],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/tmp")
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"error: the server of {tree} exited ({proc.returncode}); see {log}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                        if r.status == 200:
                            return time.monotonic() - start
                except OSError:
                    time.sleep(0.05)
        finally:
            proc.send_signal(2)
            proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", default=str(Path(__file__).resolve().parents[1]),
                   help="comma-separated source trees (checkouts) to compare")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--args", default="", help="more `specserve serve` arguments")
    p.add_argument("--port", type=int, default=8301)
    p.add_argument("--label", default=datetime.date.today().isoformat())
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    extra = shlex.split(args.args)
    logs = {tree: Path(f"/tmp/cold_start_{n}.log") for n, tree in enumerate(trees)}
    for n, tree in enumerate(trees):  # warm the caches
        ready_seconds(tree, args.port + n, extra, logs[tree])
    times = {tree: [] for tree in trees}
    for _ in range(args.repeats):
        for n, tree in enumerate(trees):
            times[tree].append(ready_seconds(tree, args.port + n, extra, logs[tree]))
    lines = [f"`python bench/cold_start.py --trees {args.trees} --repeats {args.repeats}"
             + (f" --args {shlex.quote(args.args)}" if args.args else "") + "`",
             f"machine: {cpu_name()}, {os.cpu_count()} cores; warm caches; "
             "trees interleaved round by round", "",
             "| tree | seconds to /health (each run) | median |", "|---|---|---|"]
    for tree in trees:
        lines.append(f"| {tree} | {', '.join(f'{t:.2f}' for t in times[tree])} | "
                     f"{statistics.median(times[tree]):.2f} |")
    for tree in trees:
        phases = [line.split(": ", 1)[-1] for line in logs[tree].read_text().splitlines()
                  if "startup:" in line or " ready:" in line]
        if phases:
            lines.append(f"\n{tree}, its last run: " + "; ".join(phases))
    text = "\n".join(lines) + "\n"
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.label}.md").write_text(text)


if __name__ == "__main__":
    main()
