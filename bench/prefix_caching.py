"""Prefix caching on what it is for: multi-turn conversations and a long shared system prompt, the default
server (speculation on) with the cache (the default) and with `--no-enable-prefix-caching`.

    python bench/prefix_caching.py --name 2026-11-29      # ~15 min on 2 CPU cores

For each configuration, one server: (1) a ~2,000-token system prompt asked twice with different questions:
the second question's TTFT against the first's; (2) --conversations conversations of --turns turns
(benchmark/conversations.py: MT-Bench, each turn re-sending the history with the model's own replies),
starting as Poisson arrivals at --rate, greedy, natural EOS within --max-tokens: mean TTFT and E2E per turn,
the server's prefix-cache hit rate, and each conversation's replies, which must be the same with and without
the cache. Writes bench/results/prefix_caching/<name>.json and prints the tables; exits 1 if a goal is missed
(issue 61: turns >= 2 mean TTFT >= 3x lower, mean E2E lower, output unchanged; second system-prompt TTFT <=
1/10 of the first).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from stress import start_server  # noqa: E402

from specserve.benchmark.client import RequestResult, StreamingClient, make_http_client, monotonic_clock  # noqa: E402
from specserve.benchmark.conversations import build_conversations, execute_conversations, per_turn  # noqa: E402
from specserve.benchmark.machine import cpu_model, git_commit  # noqa: E402
from specserve.benchmark.prompts import load_dataset  # noqa: E402
from specserve.benchmark.server_metrics import scrape  # noqa: E402

OUT = Path(__file__).parent / "results" / "prefix_caching"
CONFIGS = {"cache": "", "no cache": "--no-enable-prefix-caching"}
SYSTEM_CHARS = 8000  # ~2,000 tokens of English prose


class _Quiet:
    def advance(self, ok: bool) -> None:
        pass


async def measure(url: str, args) -> dict:
    http = make_http_client(url, 600.0)
    client = StreamingClient(http, url, args.model, "chat", ignore_eos=False, temperature=0.0)
    try:
        system = ""
        for text in load_dataset("spec-bench"):
            system += text + "\n"
            if len(system) >= SYSTEM_CHARS:
                break
        shared = []
        for question in ("Summarise the text above in one sentence.", "Which topic comes up most often above?"):
            r = RequestResult(id=-1, arrival_s=0.0, max_tokens=8)
            await client.send(r, "", monotonic_clock(), messages=[{"role": "system", "content": system},
                                                                 {"role": "user", "content": question}])
            shared.append({"ttft_s": r.ttft_s, "prompt_tokens": r.prompt_tokens, "error": r.error})
        before = await scrape(http, url)
        conversations = build_conversations(args.conversations, args.turns, args.seed)
        starts = np.cumsum(np.random.default_rng(args.seed).exponential(1 / args.rate, len(conversations)))
        results = await execute_conversations(client, conversations, starts - starts[0], args.max_tokens,
                                              args.think_time, _Quiet())
        after = await scrape(http, url)
    finally:
        await http.aclose()
    hits = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
    queries = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
    later = [r for r in results if r.ok and r.turn >= 1]
    return {"system_prompt": shared, "turns": per_turn(results), "failed": sum(not r.ok for r in results),
            "mean_ttft_later_turns_s": float(np.mean([r.ttft_s for r in later])),
            "mean_e2e_s": float(np.mean([r.e2e_s for r in results if r.ok])),
            "hit_rate": hits / queries if queries else None,
            "replies": [r.text for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conversations", type=int, default=50)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.25, help="conversations started per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    args.max_num_seqs, args.max_queue = 64, 1000  # start_server's
    runs = {}
    for label, flags in CONFIGS.items():
        args.server_args = flags
        log = Path(f"/tmp/prefix_caching_{label.replace(' ', '_')}.log")
        proc, url = start_server(args, log)
        try:
            runs[label] = asyncio.run(measure(url, args))
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"{label}: {json.dumps({k: v for k, v in runs[label].items() if k != 'replies'})}", flush=True)
    on, off = runs["cache"], runs["no cache"]
    same = sum(a == b for a, b in zip(on["replies"], off["replies"]))
    ttft = [s["ttft_s"] for s in on["system_prompt"]]
    checks = {
        "turns >= 2: mean TTFT >= 3x lower with the cache":
            off["mean_ttft_later_turns_s"] >= 3 * on["mean_ttft_later_turns_s"],
        "mean E2E lower with the cache": on["mean_e2e_s"] < off["mean_e2e_s"],
        "replies unchanged": same == len(off["replies"]) and not on["failed"] and not off["failed"],
        "shared system prompt: second TTFT <= 1/10 of the first": ttft[1] <= ttft[0] / 10,
    }
    lines = ["| turn | mean prompt tokens | TTFT cache (s) | TTFT no cache (s) | E2E cache (s) | E2E no cache (s) |",
             "|---|---|---|---|---|---|"]
    for a, b in zip(on["turns"], off["turns"]):
        lines.append(f"| {a['turn']} | {a['mean_prompt_tokens']:.0f} | {a['mean_ttft_s']:.3f} | "
                     f"{b['mean_ttft_s']:.3f} | "
                     f"{a['mean_e2e_s']:.3f} | {b['mean_e2e_s']:.3f} |")
    lines += ["", f"replies identical: {same} of {len(off['replies'])}; prefix-cache hit rate {on['hit_rate']:.1%}",
              f"system prompt of {on['system_prompt'][0]['prompt_tokens']} tokens: TTFT first / second question "
              f"{ttft[0]:.2f} / {ttft[1]:.3f} s with the cache, "
              f"{off['system_prompt'][0]['ttft_s']:.2f} / {off['system_prompt'][1]['ttft_s']:.2f} s without", ""]
    lines += [f"- {name}: {'PASS' if ok else 'MISS'}" for name, ok in checks.items()]
    print("\n".join(lines))
    cpu = cpu_model()
    commit = git_commit()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.name}.json").write_text(json.dumps({
        "command": "python bench/prefix_caching.py " + " ".join(sys.argv[1:]), "commit": commit, "cpu": cpu,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "config": vars(args), "runs": runs,
        "table": lines, "checks": checks}, indent=1))
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
