"""What the serving path adds to a token at batch 1: the client's TPOT through `specserve serve` (engine in its
own process, the default, and on a thread of the server with --engine-thread) against the engine's own
decode step, measured in-process on the same prompts.

    python bench/serving_overhead.py [--repeats 3] [--requests 8] [--threads 2]

Server runs: `specserve bench` closed loop, one request at a time, 256-token Spec-Bench prompts, 64 output
tokens, greedy, EOS ignored, plain decoding (so a token is a step). Engine: `LLM` with the same settings,
the median time of its decode steps. Modes are interleaved round by round; the table gives medians and
min-max. Results: bench/results/serving_overhead/<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

OUT = Path(__file__).parent / "results" / "serving_overhead"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64


def serve(threads: int, thread_mode: bool, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specserve", "serve", "--port", "0", "--speculative-config", "none",
           "--num-threads", str(threads), "--disable-access-log"] + (["--engine-thread"] if thread_mode else [])
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        text = log.read_text()
        if "specserve serving http" in text:
            url = text.split("specserve serving ")[1].split("/v1")[0]
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(log.read_text())
        time.sleep(0.2)
    raise RuntimeError("server did not start")


def server_tpot(threads: int, thread_mode: bool, requests: int, tokenizer: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(threads, thread_mode, Path(tmp) / "server.log")
        try:
            results = Path(tmp) / "run.jsonl"
            subprocess.run([sys.executable, "-m", "specserve", "bench", "--base-url", url, "--max-concurrency", "1",
                            "--max-requests", str(requests), "--input-len", str(PROMPT_TOKENS),
                            "--output-len", str(OUTPUT_TOKENS), "--dataset", "spec-bench", "--tokenizer", tokenizer,
                            "--results", str(results), "--no-progress"], check=True, capture_output=True)
            run = json.loads(results.read_text().splitlines()[0])
            return run["tpot_s"]["median"]
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(60)


def engine_step(threads: int, requests: int) -> float:
    """The engine's median decode step at batch 1, in a process of its own (threads are per process)."""
    code = f"""
import json, statistics, sys
sys.path.append({str(Path(__file__).resolve().parent.parent)!r})
from specserve import LLM, SamplingParams
from bench.engine_throughput import load_prompts
llm = LLM(model="smollm2-135m", num_threads={threads}, max_num_batched_tokens=512)
engine, steps = llm.engine, []
for p in load_prompts(llm.tokenizer, {requests}, {PROMPT_TOKENS}):
    engine.add_request(p, SamplingParams(max_tokens={OUTPUT_TOKENS}, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        s = engine.last_stats
        if s.num_decodes and not s.num_prefill_tokens:
            steps.append(s.t_total)
print(json.dumps(statistics.median(steps)))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from specserve.model.registry import fetch
    tokenizer = str(fetch("smollm2-135m", quiet=True))
    modes = {"engine step (in-process LLM)": lambda: engine_step(args.threads, args.requests),
             "serve (engine process)": lambda: server_tpot(args.threads, False, args.requests, tokenizer),
             "serve --engine-thread": lambda: server_tpot(args.threads, True, args.requests, tokenizer)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, measure in modes.items():
            times[mode].append(measure())
            print(f"round {r + 1}: {mode}: {times[mode][-1] * 1000:.1f} ms", flush=True)
    base = statistics.median(times["engine step (in-process LLM)"])
    rows = [{"mode": m, "median_ms": statistics.median(t) * 1000, "min_ms": min(t) * 1000, "max_ms": max(t) * 1000,
             "vs_engine_step": statistics.median(t) / base} for m, t in times.items()]
    print("\n| batch 1, plain decoding | per token (ms), median | min-max | vs the engine's step |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['median_ms']:.1f} | {row['min_ms']:.1f}-{row['max_ms']:.1f} | "
              f"{row['vs_engine_step']:.3f}x |")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{datetime.date.today()}.json"
    path.write_text(json.dumps({"threads": args.threads, "requests": args.requests, "repeats": args.repeats,
                                "rows": rows}, indent=1))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
