"""Overload: ~3x the measured saturation rate for 60 s against `specserve serve --max-queue 4` (issue 47).

The server must shed what it cannot serve instead of slowing down or growing: `/health` stays under
100 ms throughout, RSS levels off, every accepted request completes with all its tokens, every other one
gets 429 with Retry-After, and a lone request is as fast afterwards as before.

Phases: warm-up; a lone request's latency (median of 5); saturation, as the completion rate of a closed
loop holding `max_num_seqs + max_queue` requests (all the server admits) for --saturation-s and at least
until twice that many have completed (a slow machine needs longer); overload,
arrivals at --factor x that rate (Poisson) for --duration-s, each a streamed completion of --max-tokens
tokens (ignore_eos, so "all its tokens" is exact); a lone request's latency again. /health is probed every
100 ms from a separate process (so the load generator's own event loop does not inflate it), and the
server's RSS (with its engine process) is sampled every 0.5 s from /proc.

    python bench/stress.py [--model smollm2-135m] [--max-num-seqs 8] [--max-queue 4] [--duration-s 60]
                           [--factor 3] [--max-tokens 64] [--server-args '--num-threads 2'] [--name NAME]

Prints a table; writes bench/results/stress/<name>.json. The load generator runs on the same machine as
the server and takes CPU from it: on 2 cores, say so when quoting the numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specserve.benchmark.machine import cpu_model, git_commit

OUT = Path(__file__).parent / "results" / "stress"
URL_RE = re.compile(r"specserve serving (http://127\.0\.0\.1:\d+)/v1")
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List some uses of the Fourier transform.", "def quicksort(xs):", "The history of the bicycle",
           "Describe a walk through a forest in autumn.", "What makes a good unit test?",
           "Translate to French: the cat sleeps on the warm windowsill."]
HEALTH_LIMIT_S = 0.1


# ---- the server --------------------------------------------------------------------------------------------

def start_server(args, log_path: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specserve", "serve", "--host", "127.0.0.1", "--port", "0", "--model", args.model,
           "--max-num-seqs", str(args.max_num_seqs), "--max-queue", str(args.max_queue), "--disable-access-log",
           *shlex.split(args.server_args)]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        m = URL_RE.search(log_path.read_text(errors="replace"))
        if m:
            try:
                if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                    return proc, m.group(1)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not ready after 300 s")


def rss_bytes(pid: int, children: bool = True) -> int:
    """RSS of the server and (by default) its descendants (the engine runs in a child process)."""
    total = 0
    for p in [pid, *(descendants(pid) if children else [])]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def descendants(pid: int) -> list[int]:
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            pass
    out, frontier = [], [pid]
    while frontier:
        children = [c for c, ppid in parents.items() if ppid in frontier]
        out += children
        frontier = children
    return out


def health_probe(root: str, interval: float, stop, out) -> None:
    """In its own process: /health latency every `interval` s until `stop` is set; (t, seconds, status)."""
    samples = []
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t = time.time()
            try:
                status = http.get(root + "/health").status_code
            except httpx.HTTPError:
                status = -1
            samples.append((t, time.time() - t, status))
            time.sleep(max(0.0, interval - (time.time() - t)))
    out.put(samples)


def save(result: dict, args, code: int, log_path: Path, out_dir: Path, table) -> None:
    """Records what the run was (config, commit, CPU, date, the server's exit and traceback) in `result`,
    prints `table(result)`, writes out_dir/<args.name>.json and exits 0 only if every check passed."""
    log = log_path.read_text(errors="replace")
    commit = git_commit()
    cpu = cpu_model()
    startup = next((line for line in log.splitlines() if "specserve serving" in line), "")
    result.update(config=vars(args), commit=commit, cpu=cpu, cpus=os.cpu_count(), server_exit_code=code,
                  server_line=startup.split("specserve: ", 1)[-1], traceback_in_log="Traceback" in log,
                  date=datetime.datetime.now().isoformat(timespec="seconds"))
    result["checks"]["server exited 0, no traceback"] = code == 0 and not result["traceback_in_log"]
    print()
    print(table(result))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{args.name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"\nwritten {path} (server log: {log_path})")
    sys.exit(0 if all(result["checks"].values()) else 1)


# ---- the load -------------------------------------------------------------------------------------------------

async def one(http: httpx.AsyncClient, url: str, body: dict, first_token: asyncio.Event | None = None) -> dict:
    """A streamed completion to its end: status, tokens, [DONE], the error event if any, TTFT, latency
    (`start` and `latency` on the wall clock). `first_token` is set when its first token arrives."""
    t0 = time.time()
    r = {"start": t0, "status": None, "retry_after": None, "tokens": 0, "done": False, "error": None}
    try:
        async with http.stream("POST", url, json=body) as resp:
            r["status"], r["retry_after"] = resp.status_code, resp.headers.get("retry-after")
            if resp.status_code != 200:
                r["error"] = (json.loads(await resp.aread()).get("error") or {}).get("message")
            else:
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        r["done"] = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            r["error"] = chunk["error"]["message"]
                        elif chunk.get("usage"):
                            r["tokens"] = chunk["usage"]["completion_tokens"]
                        elif r.get("ttft") is None:
                            r["ttft"] = time.time() - t0
                            if first_token is not None:
                                first_token.set()
    except httpx.HTTPError as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["latency"] = time.time() - t0
    return r


def body(args, i: int) -> dict:
    return {"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def saturation(http, url: str, make_body, capacity: int, seconds: float) -> float:
    """Completions per second of a closed loop holding `capacity` requests for `seconds` and at least until
    twice that many have completed (a slow machine needs longer)."""
    done, t_end = [], time.time() + seconds
    t0 = time.time()

    async def worker(k):
        i = k
        while time.time() < t_end or len(done) < 2 * capacity:
            done.append(await one(http, url, make_body(i)))
            i += capacity
    await asyncio.gather(*(worker(k) for k in range(capacity)))
    ok = [r for r in done if r["status"] == 200 and r["done"]]
    if len(ok) < len(done):
        print(f"({len(done) - len(ok)} of the saturation run's requests did not complete)", flush=True)
    return len(ok) / (time.time() - t0)


async def lone_latency(http, url, args, n=5) -> float:
    return statistics.median([(await one(http, url, body(args, i)))["latency"] for i in range(n)])


async def run(args, root: str, pid: int) -> dict:
    url = root + "/v1/completions"
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        print("warm-up ...", flush=True)
        for i in range(3):
            await one(http, url, body(args, i))
        lone_before = await lone_latency(http, url, args)
        print(f"lone request: {lone_before:.2f} s", flush=True)

        capacity = args.max_num_seqs + args.max_queue
        print(f"saturation: closed loop of {capacity} requests for {args.saturation_s:.0f} s and at least "
              f"{2 * capacity} completions ...", flush=True)
        rate = await saturation(http, url, lambda i: body(args, i), capacity, args.saturation_s)
        offered = args.factor * rate
        print(f"saturation rate {rate:.2f} req/s; offering {offered:.2f} req/s for {args.duration_s:.0f} s ...",
              flush=True)

        stop, queue = multiprocessing.Event(), multiprocessing.Queue()
        prober = multiprocessing.Process(target=health_probe, args=(root, 0.1, stop, queue), daemon=True)
        prober.start()
        rss, tasks, rng = [], [], random.Random(args.seed)

        async def sample_rss():
            while not stop.is_set():
                rss.append((time.time(), rss_bytes(pid)))
                await asyncio.sleep(0.5)
        sampler = asyncio.create_task(sample_rss())
        t_start = time.time()
        next_at, i = t_start, 0
        while next_at < t_start + args.duration_s:
            await asyncio.sleep(max(0.0, next_at - time.time()))
            tasks.append(asyncio.create_task(one(http, url, body(args, i))))
            i += 1
            next_at += rng.expovariate(offered)
        arrivals_end = time.time()
        results = await asyncio.gather(*tasks)
        drained = time.time()
        await asyncio.sleep(1.0)  # a little idle time on the probe too
        stop.set()
        await sampler
        probes = queue.get(timeout=60)
        prober.join(10)
        lone_after = await lone_latency(http, url, args)
        print(f"lone request after: {lone_after:.2f} s", flush=True)

    accepted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    complete = [r for r in accepted if r["done"] and r["error"] is None and r["tokens"] == args.max_tokens]
    proper_429 = [r for r in refused if r["status"] == 429 and r["retry_after"]]
    during = [p for p in probes if t_start <= p[0] <= drained]
    health = sorted(p[1] for p in during)
    rss_values = [v for _, v in rss]
    half = [v for t, v in rss if t >= t_start + args.duration_s / 2]
    lat = sorted(r["latency"] for r in complete)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
    summary = {
        "lone_latency_before_s": lone_before, "lone_latency_after_s": lone_after,
        "saturation_rps": rate, "offered_rps": offered, "duration_s": args.duration_s,
        "arrivals": len(results), "arrival_window_s": arrivals_end - t_start, "drain_s": drained - arrivals_end,
        "accepted": len(accepted), "completed_all_tokens": len(complete), "refused": len(refused),
        "refused_429_with_retry_after": len(proper_429),
        "refused_other": sorted({f"{r['status']}: {r['error']}" for r in refused if r not in proper_429}),
        "accepted_failures": [r for r in accepted if r not in complete][:5],
        "accepted_latency_p50_s": pct(lat, 0.5), "accepted_latency_p99_s": pct(lat, 0.99),
        "health_probes": len(health), "health_p50_ms": 1000 * pct(health, 0.5),
        "health_p99_ms": 1000 * pct(health, 0.99), "health_max_ms": 1000 * health[-1],
        "health_not_200": sum(1 for p in during if p[2] != 200),
        "rss_start_mb": rss_values[0] / 2**20, "rss_peak_mb": max(rss_values) / 2**20,
        "rss_end_mb": rss_values[-1] / 2**20,
        "rss_second_half_growth_mb": (max(half) - half[0]) / 2**20 if half else None,
    }
    checks = {
        "health < 100 ms throughout": summary["health_max_ms"] < 1000 * HEALTH_LIMIT_S and not summary["health_not_200"],
        "every accepted request completed": len(complete) == len(accepted) > 0,
        "every other one got 429 + Retry-After": len(proper_429) == len(refused) > 0,
        "RSS levels off (second half grows < 5 %)": summary["rss_second_half_growth_mb"] is not None
        and summary["rss_second_half_growth_mb"] < 0.05 * summary["rss_start_mb"],
        "lone latency back to normal (< 1.5x before)": lone_after < 1.5 * lone_before,
    }
    timeline = [{"t": round(t - t_start, 2), "rss_mb": round(v / 2**20, 1)} for t, v in rss]
    return {"summary": summary, "checks": checks, "rss_timeline": timeline,
            "health_ms_by_second": _by_second(during, t_start)}


def _by_second(probes, t0) -> list[dict]:
    out: dict[int, list[float]] = {}
    for t, s, _ in probes:
        out.setdefault(int(t - t0), []).append(s * 1000)
    return [{"second": k, "max_ms": round(max(v), 1), "n": len(v)} for k, v in sorted(out.items())]


def table(result: dict) -> str:
    s, c = result["summary"], result["checks"]
    rows = [
        ("lone request latency before / after", f"{s['lone_latency_before_s']:.2f} s / {s['lone_latency_after_s']:.2f} s"),
        ("saturation rate (closed loop, all admitted)", f"{s['saturation_rps']:.2f} req/s"),
        ("offered rate (Poisson) x duration", f"{s['offered_rps']:.2f} req/s x {s['duration_s']:.0f} s"),
        ("arrivals / accepted / refused", f"{s['arrivals']} / {s['accepted']} / {s['refused']}"),
        ("accepted that completed with every token", f"{s['completed_all_tokens']} of {s['accepted']}"),
        ("refused with 429 + Retry-After", f"{s['refused_429_with_retry_after']} of {s['refused']}"),
        ("accepted latency p50 / p99", f"{s['accepted_latency_p50_s']:.2f} s / {s['accepted_latency_p99_s']:.2f} s"
         if s["accepted_latency_p50_s"] is not None else "-"),
        ("/health p50 / p99 / max (probes)", f"{s['health_p50_ms']:.1f} / {s['health_p99_ms']:.1f} / "
                                             f"{s['health_max_ms']:.1f} ms ({s['health_probes']})"),
        ("RSS start / peak / end", f"{s['rss_start_mb']:.0f} / {s['rss_peak_mb']:.0f} / {s['rss_end_mb']:.0f} MiB"),
        ("drain after the last arrival", f"{s['drain_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + [""]
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in c.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=4)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--saturation-s", type=float, default=20.0)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="", help="more `specserve serve` flags, e.g. '--num-threads 2'")
    ap.add_argument("--seed", type=int, default=0, help="arrival times")
    ap.add_argument("--name", default=str(datetime.date.today()))
    ap.add_argument("--note", default="", help="recorded with the results (e.g. 'machine shared with other work')")
    args = ap.parse_args()

    log_path = Path(tempfile.mkdtemp(prefix="stress-")) / "server.log"
    load_before = os.getloadavg()
    proc, root = start_server(args, log_path)
    try:
        result = asyncio.run(run(args, root, proc.pid))
    finally:
        proc.terminate()
        code = proc.wait(60)
    result["loadavg_before"] = load_before
    save(result, args, code, log_path, OUT, table)


if __name__ == "__main__":
    main()
