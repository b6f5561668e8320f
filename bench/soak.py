"""Soak: ~70 % of the measured saturation rate for 30+ minutes of mixed traffic (issue 62).

Over hours a server must stay flat: memory, file descriptors, KV blocks and latency. Arrivals (Poisson) are
a mix of streamed completions (60 %), non-streamed ones (30 %), clients that disconnect after their first
token (8 %) and hostile requests (2 %: malformed JSON, wrong types, unknown model, a negative max_tokens,
each must get a 4xx). Every --idle-every-s the arrivals pause until nothing is in flight, and the KV cache
usage and open file descriptors are read there, once the server has closed idle keep-alive connections: an
idle server holds no blocks. RSS of the server and of
its engine process is sampled every 5 s. Latency p99 per 5-minute window of completed requests.

    python bench/soak.py [--duration-s 1920] [--load 0.7] [--server-args '--num-threads 1'] [--name NAME]

Goals: RSS growth <= 5 % between the 10th and the 30th minute; file descriptors flat at idle; every KV block
free at idle; p99 of every window within 1.3x of the first's; no 5xx, no accepted request lost. Writes
bench/results/soak/<name>.json and prints a table. The load generator shares the machine with the server.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from stress import PROMPTS, descendants, one, rss_bytes, saturation, save, start_server  # noqa: E402

OUT = Path(__file__).parent / "results" / "soak"
WINDOW_S = 300
HOSTILE = [b'{"prompt": "unterminated', b'{"prompt": 5, "max_tokens": 4}', b'{"prompt": "x", "max_tokens": -1}',
           b'{"model": "no-such-model", "prompt": "x"}', b'{"prompt": "x", "temperature": "hot"}']


def fds(pid: int) -> int:
    """Open file descriptors of the server and its descendants (the engine process)."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            total += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass
    return total


async def non_streamed(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.time()
    r = {"start": t0, "kind": "plain", "status": None, "tokens": 0, "done": False, "error": None}
    try:
        plain = {k: v for k, v in body.items() if k != "stream_options"}  # only allowed with stream: true
        resp = await http.post(url, json=dict(plain, stream=False))
        r["status"] = resp.status_code
        if resp.status_code == 200:
            r["tokens"], r["done"] = resp.json()["usage"]["completion_tokens"], True
        else:
            r["error"] = resp.text[:200]
    except httpx.HTTPError as e:
        r["error"] = f"{type(e).__name__}: {e}"
    r["latency"] = time.time() - t0
    return r


async def disconnecting(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Streams until the first token, then goes away (the server must abort it and free its blocks)."""
    r = {"start": time.time(), "kind": "disconnect", "status": None, "error": None}
    try:
        async with http.stream("POST", url, json=body) as resp:
            r["status"] = resp.status_code
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    break
    except httpx.HTTPError as e:
        r["error"] = f"{type(e).__name__}: {e}"
    return r


async def hostile(http: httpx.AsyncClient, url: str, raw: bytes) -> dict:
    resp = await http.post(url, content=raw, headers={"content-type": "application/json"})
    return {"start": time.time(), "kind": "hostile", "status": resp.status_code}


async def metric(http: httpx.AsyncClient, root: str, name: str) -> float:
    text = (await http.get(root + "/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


async def run(args, root: str, pid: int) -> dict:
    url = root + "/v1/completions"

    def body(i: int) -> dict:
        return {"model": args.model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        for i in range(3):
            await one(http, url, body(i))
        rate = await saturation(http, url, body, args.max_num_seqs, args.saturation_s)
        offered = args.load * rate
        print(f"saturation {rate:.2f} req/s; offering {offered:.2f} req/s for {args.duration_s:.0f} s", flush=True)
        rng, tasks, samples, idle = random.Random(args.seed), [], [], []
        t0 = time.time()
        next_at, next_idle, i = t0, t0 + args.idle_every_s, 0

        async def sample():
            while True:
                samples.append({"t": time.time() - t0, "rss_server": rss_bytes(pid, children=False),
                                "rss_engine": sum(rss_bytes(c, children=False) for c in descendants(pid)),
                                "fds": fds(pid)})
                await asyncio.sleep(5)
        sampler = asyncio.create_task(sample())
        while next_at < t0 + args.duration_s:
            if next_at >= next_idle:  # pause: let everything finish, then read the idle state
                await asyncio.gather(*[t for t in tasks if not t.done()])
                # Past the server's keep-alive timeout (5 s): the pool's idle connections are closed, so the
                # descriptors counted are the server's own (and the aborts of disconnected streams have landed).
                await asyncio.sleep(6.0)
                idle.append({"t": time.time() - t0,
                             "kv_usage": await metric(http, root, "specserve:kv_cache_usage_perc"),
                             "running": await metric(http, root, "specserve:num_requests_running"),
                             "fds": fds(pid)})
                print(f"{idle[-1]['t'] / 60:5.1f} min idle: KV {idle[-1]['kv_usage']:.3f}, FDs {idle[-1]['fds']}, "
                      f"RSS {(samples[-1]['rss_server'] + samples[-1]['rss_engine']) / 2**20:.0f} MiB", flush=True)
                next_at, next_idle = time.time(), time.time() + args.idle_every_s
            await asyncio.sleep(max(0.0, next_at - time.time()))
            u = rng.random()
            if u < 0.60:
                job = one(http, url, body(i))
            elif u < 0.90:
                job = non_streamed(http, url, body(i))
            elif u < 0.98:
                job = disconnecting(http, url, body(i))
            else:
                job = hostile(http, url, HOSTILE[i % len(HOSTILE)])
            tasks.append(asyncio.create_task(job))
            i += 1
            next_at += rng.expovariate(offered)
        results = await asyncio.gather(*tasks)
        sampler.cancel()
    return summarize(args, rate, offered, t0, results, samples, idle)


def summarize(args, rate, offered, t0, results, samples, idle) -> dict:
    served = [r for r in results if r.get("kind", "stream") in ("stream", "plain")]
    for r in served:
        r.setdefault("kind", "stream")
    complete = [r for r in served if r["status"] == 200 and r["done"] and r["tokens"] == args.max_tokens]
    windows = {}
    for r in complete:
        windows.setdefault(int((r["start"] - t0) // WINDOW_S), []).append(r["latency"])
    p99 = [sorted(v)[min(len(v) - 1, int(0.99 * len(v)))] for _, v in sorted(windows.items())]

    def rss_at(minute):
        near = min(samples, key=lambda s: abs(s["t"] - 60 * minute))
        return near["rss_server"] + near["rss_engine"]
    rss10, rss30 = rss_at(10), rss_at(30)
    summary = {
        "saturation_rps": rate, "offered_rps": offered, "duration_s": args.duration_s, "arrivals": len(results),
        "served": len(served), "completed_all_tokens": len(complete),
        "lost": [{k: r.get(k) for k in ("kind", "status", "tokens", "error")} for r in served if r not in complete][:5],
        "disconnects": sum(r.get("kind") == "disconnect" for r in results),
        "hostile": sum(r.get("kind") == "hostile" for r in results),
        "hostile_statuses": sorted({r["status"] for r in results if r.get("kind") == "hostile"}),
        "any_5xx": sum((r.get("status") or 0) >= 500 for r in results),
        "p99_by_window_s": p99, "rss_10min_mb": rss10 / 2**20, "rss_30min_mb": rss30 / 2**20,
        "rss_growth_10_30": rss30 / rss10 - 1, "idle_points": idle,
    }
    checks = {
        "RSS growth 10th -> 30th minute <= 5 %": summary["rss_growth_10_30"] <= 0.05,
        "FDs flat at idle (within 2)": max(p["fds"] for p in idle) - min(p["fds"] for p in idle) <= 2,
        "every KV block free at idle": all(p["kv_usage"] == 0 and p["running"] == 0 for p in idle),
        "p99 of every window <= 1.3x the first's": bool(p99) and max(p99) <= 1.3 * p99[0],
        "no 5xx; hostile requests all 4xx": not summary["any_5xx"]
        and all(400 <= s < 500 for s in summary["hostile_statuses"]),
        "no accepted request lost": len(complete) == len(served),
    }
    return {"summary": summary, "checks": checks, "samples": samples}


def table(result: dict) -> str:
    s, c = result["summary"], result["checks"]
    rows = [("saturation / offered", f"{s['saturation_rps']:.2f} / {s['offered_rps']:.2f} req/s for "
                                     f"{s['duration_s'] / 60:.0f} min"),
            ("arrivals: served / disconnects / hostile", f"{s['served']} / {s['disconnects']} / {s['hostile']}"),
            ("served that completed with every token", f"{s['completed_all_tokens']} of {s['served']}"),
            ("p99 latency by 5-minute window", " ".join(f"{x:.2f}" for x in s["p99_by_window_s"]) + " s"),
            ("RSS (server + engine) at 10 / 30 min", f"{s['rss_10min_mb']:.0f} / {s['rss_30min_mb']:.0f} MiB "
                                                     f"({100 * s['rss_growth_10_30']:+.1f} %)"),
            ("at idle: KV usage / FDs", ", ".join(f"{p['kv_usage']:.3f}/{p['fds']}" for p in s["idle_points"]))]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + [""]
    return "\n".join(lines + [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in c.items()])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--duration-s", type=float, default=1920.0)
    ap.add_argument("--saturation-s", type=float, default=30.0)
    ap.add_argument("--load", type=float, default=0.7, help="fraction of the measured saturation rate")
    ap.add_argument("--idle-every-s", type=float, default=300.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-args", default="--num-threads 1", help="more `specserve serve` flags")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=str(datetime.date.today()))
    args = ap.parse_args()
    log_path = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    proc, root = start_server(args, log_path)
    try:
        result = asyncio.run(run(args, root, proc.pid))
    finally:
        proc.terminate()
        code = proc.wait(60)
    save(result, args, code, log_path, OUT, table)


if __name__ == "__main__":
    main()
