"""Engine death under load, timed (issue 62's goals): SIGKILL the engine process of `specserve serve` while
streams are in flight, and measure how long each stream takes to end with an error and how long until the
server serves again (the new engine process loads the model; its step-cost profile comes from the cache).

    python bench/chaos.py [--streams 6] [--rounds 3] [--server-args ''] [--name NAME]

Goals: every in-flight stream ends with an error event within 5 s of the kill; serving again within 30 s;
no request hangs. Writes bench/results/chaos/<name>.json and prints a table. The tests
(tests/server/test_server_supervision.py) check the same behaviour without timing it.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from stress import PROMPTS, start_server  # noqa: E402

OUT = Path(__file__).parent / "results" / "chaos"
ENGINE_READY_RE = re.compile(r"engine process (\d+) ready")


async def stream_until_end(http: httpx.AsyncClient, url: str, body: dict, started: asyncio.Event) -> dict:
    """Streams; sets `started` at the first token; returns when the stream ends (time, error, [DONE])."""
    out = {"error": None, "done": False}
    async with http.stream("POST", url, json=body) as resp:
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out["error"] = chunk["error"]["message"]
                started.set()
    out["ended"] = time.monotonic()
    return out


async def one_round(root: str, log_path: Path, n: int, model: str) -> dict:
    url = root + "/v1/completions"
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with httpx.AsyncClient(timeout=120) as http:
        started = [asyncio.Event() for _ in range(n)]
        tasks = [asyncio.create_task(stream_until_end(http, url, dict(body, prompt=PROMPTS[i % len(PROMPTS)]), e))
                 for i, e in enumerate(started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
        pid = int(ENGINE_READY_RE.findall(log_path.read_text(errors="replace"))[-1])
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        ends = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        while True:  # serving again: a completion answered 200
            try:
                r = await http.post(url, json={"model": model, "prompt": "hi", "max_tokens": 2})
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
            if time.monotonic() - killed > 300:
                raise SystemExit("not serving again 300 s after the kill")
        back = time.monotonic() - killed
    return {"stream_end_s": [e["ended"] - killed for e in ends], "errors": [e["error"] for e in ends],
            "done": [e["done"] for e in ends], "serving_again_s": back}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--server-args", default="", help="more `specserve serve` flags")
    ap.add_argument("--name", default=str(datetime.date.today()))
    args = ap.parse_args()
    args.max_queue = 64
    log_path = Path(tempfile.mkdtemp(prefix="chaos-")) / "server.log"
    proc, root = start_server(args, log_path)
    try:
        rounds = [asyncio.run(one_round(root, log_path, args.streams, args.model)) for _ in range(args.rounds)]
        restarts = httpx.get(root + "/metrics").text
    finally:
        proc.terminate()
        code = proc.wait(60)
    ends = [t for r in rounds for t in r["stream_end_s"]]
    backs = [r["serving_again_s"] for r in rounds]
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in restarts.splitlines()
                  if line.startswith("specserve:engine_restarts_total{"))
    checks = {
        "every stream ended with an error event and [DONE]": all(e and d for r in rounds
                                                                 for e, d in zip(r["errors"], r["done"])),
        "within 5 s of the kill": max(ends) <= 5.0,
        "serving again within 30 s": max(backs) <= 30.0,
        "restarts counted": counted == args.rounds,
        "server exited 0": code == 0,
    }
    cpu = next((l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                if l.startswith("model name")), "?")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"rounds": rounds, "checks": checks, "config": vars(args), "commit": commit, "cpu": cpu,
              "date": datetime.datetime.now().isoformat(timespec="seconds")}
    print(f"streams ended after the kill: median {statistics.median(ends):.2f} s, max {max(ends):.2f} s "
          f"({len(ends)} streams, {args.rounds} kills)")
    print(f"serving again after: {', '.join(f'{b:.1f}' for b in backs)} s; restarts counted {counted:.0f}")
    print("\n".join(f"{'PASS' if ok else 'FAIL'}  {k}" for k, ok in checks.items()))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    print(f"written {OUT / (args.name + '.json')} (server log: {log_path})")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
