"""Thread defaults under contention: `specserve generate` of 64 tokens while another process keeps one core
busy, with the default threads and with each `--num-threads` choice, and the same on an idle machine.

    python bench/contention.py [--repeats 5] [--max-threads 2] [--wait-policies passive,active,spin=N]

--wait-policies adds the default threads under other OpenMP wait policies (OMP_WAIT_POLICY=PASSIVE or
ACTIVE, or GOMP_SPINCOUNT=N with no policy): `import specserve` sets GOMP_SPINCOUNT=3000 unless the user
set either.

Runs are interleaved (round by round, every choice once per round) and each prints its own generation time
(model loading excluded); the table gives medians and the spread (min-max). Results:
bench/results/contention/<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).parent / "results" / "contention"
COMMAND = ["generate", "--prompt", "Hello there", "--max-tokens", "64", "--temperature", "0",
           "--speculative-config", "none"]


def policy_env(policy: str | None) -> dict:
    """The environment of one wait policy (None: specserve's default)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}  # the defaults, really
    if policy and policy.startswith("spin="):
        env["GOMP_SPINCOUNT"] = policy[len("spin="):]
    elif policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def generate_seconds(threads: int | None, policy: str | None = None) -> float:
    cmd = [sys.executable, "-m", "specserve", *COMMAND] + ([] if threads is None else ["--num-threads", str(threads)])
    env = policy_env(policy)
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    return float(re.search(r"tokens in ([0-9.]+) s", out).group(1))


def busy() -> subprocess.Popen:
    """One process spinning on one core (wherever the OS puts it), as any other program would."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-threads", type=int, default=os.cpu_count())
    ap.add_argument("--wait-policies", default="", help="comma-separated: passive, active, spin=N")
    args = ap.parse_args()
    # (threads, wait policy); None: the defaults
    choices = [(None, None)] + [(n, None) for n in range(1, args.max_threads + 1)]
    choices += [(None, p) for p in args.wait_policies.split(",") if p]
    label = lambda c: f"{c[0] or 'default'}" + (f", {c[1]}" if c[1] else "")  # noqa: E731
    times = {(load, c): [] for load in ("idle", "busy") for c in choices}
    for r in range(args.repeats):
        for load in ("idle", "busy"):
            hog = busy() if load == "busy" else None
            try:
                for c in choices:
                    times[load, c].append(generate_seconds(*c))
                    print(f"round {r + 1} {load:4} threads={label(c)}: {times[load, c][-1]:.2f} s", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
    rows = []
    for load in ("idle", "busy"):
        best = min(statistics.median(times[load, c]) for c in choices if c[0] is not None)
        for c in choices:
            t = times[load, c]
            rows.append({"load": load, "threads": label(c), "median_s": statistics.median(t),
                         "min_s": min(t), "max_s": max(t), "vs_best": statistics.median(t) / best})
    print("\n| machine | --num-threads (, wait policy) | 64 tokens (s), median | min-max | vs best choice |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['load']} | {row['threads']} | {row['median_s']:.2f} | {row['min_s']:.2f}-{row['max_s']:.2f} | "
              f"{row['vs_best']:.2f}x |")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{datetime.date.today()}.json"
    path.write_text(json.dumps({"command": "specserve " + " ".join(COMMAND), "cpus": os.cpu_count(),
                                "repeats": args.repeats, "rows": rows}, indent=1))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
