"""Tool calls from a real server in its default configuration (SmolLM2-135M, the shipped drafts, speculation on),
through the official client: issue 79's goal that calls of tool_choice "required" and named functions parse and
match their schema on every sampled reply.

    python bench/tool_calls.py --name 2026-12-05      # ~20 min on 2 CPU cores

Tools: the function schemas of JSONSchemaBench's Glaive rows (bench/data/jsonschemabench/glaive40.jsonl); request
i offers function i and the next two (of the 40, cyclically) and asks for function i's job. Requests at temperature
0.8 (seeds 0, 1, ...), --concurrency at a time:
1. "required" and named (function i), --samples each: every reply's calls must parse and validate against their
   function's schema (the jsonschema library), or the reply must end with finish_reason "length" (cut by
   --max-tokens).
2. "auto", --auto-samples: how many replies call a tool by themselves, and whether those calls validate (no goal:
   the model's own skill; the Hermes parser reads them).
Writes bench/results/tool_calls/<name>.json, prints a summary; exits 1 if a goal is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from pathlib import Path

import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stress import start_server  # noqa: E402

from specserve.benchmark.machine import cpu_model, git_commit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "bench" / "data" / "jsonschemabench" / "glaive40.jsonl"
OUT = ROOT / "bench" / "results" / "tool_calls"


def tool(row: dict) -> dict:
    return {"type": "function", "function": {"name": row["name"], "parameters": row["schema"]}}


def valid(name: str, arguments: str, schemas: dict) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), schemas[name])
        return True
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


async def sample(client, rows, choice: str, samples: int, args) -> list[dict]:
    """One reply per request: its finish reason, calls and whether each validates."""
    schemas = {r["name"]: r["schema"] for r in rows}
    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> dict:
        row = rows[i % len(rows)]
        tools = [tool(rows[(i + d) % len(rows)]) for d in range(3)]
        tool_choice = {"type": "function", "function": {"name": row["name"]}} if choice == "named" else choice
        messages = [{"role": "user", "content": f"Please {row['name'].replace('_', ' ')} for me, with typical "
                                                "values."}]
        async with gate:
            r = await client.chat.completions.create(model=args.model, messages=messages, tools=tools,
                                                     tool_choice=tool_choice, max_tokens=args.max_tokens,
                                                     temperature=0.8, seed=i)
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return {"finish_reason": c.finish_reason, "calls": calls, "content": c.message.content,
                "valid": [valid(n, a, schemas) for n, a in calls]}

    return await asyncio.gather(*(one(i) for i in range(samples)))


def summary(replies: list[dict]) -> dict:
    called = [r for r in replies if r["finish_reason"] == "tool_calls"]
    return {"replies": len(replies), "finished_with_calls": len(called),
            "cut_by_max_tokens": sum(r["finish_reason"] == "length" for r in replies),
            "finished_without_calls": sum(r["finish_reason"] == "stop" for r in replies),
            "calls": sum(len(r["calls"]) for r in called),
            "finished_calls_valid": sum(sum(r["valid"]) for r in called)}


async def measure(url: str, args) -> dict:
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines()]
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600) as client:
        return {choice: await sample(client, rows, choice, args.auto_samples if choice == "auto" else args.samples, args)
                for choice in ("required", "named", "auto")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=200, help="replies to required and named choices, each")
    ap.add_argument("--auto-samples", type=int, default=50, help="replies to tool_choice auto")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--server-args", default="", help="more `specserve serve` flags")
    ap.add_argument("--name", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    args.max_num_seqs, args.max_queue = 64, 1000  # start_server's
    proc, url = start_server(args, Path("/tmp/tool_calls_server.log"))
    try:
        replies = asyncio.run(measure(url, args))
    finally:
        proc.terminate()
        proc.wait(60)
    table = {choice: summary(r) for choice, r in replies.items()}
    checks = {f"{choice}: every reply's calls valid, or cut by max_tokens":
              all(r["finish_reason"] == "length" or (r["finish_reason"] == "tool_calls" and all(r["valid"]))
                  for r in replies[choice]) for choice in ("required", "named")}
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{args.name}.json"
    out.write_text(json.dumps({"commit": git_commit(), "cpu": cpu_model(), "args": vars(args), "summary": table,
                               "checks": checks, "replies": replies}, indent=1))
    print(json.dumps({"summary": table, "checks": checks}, indent=1))
    print(f"wrote {out}")
    sys.exit(0 if all(checks.values()) else 1)


if __name__ == "__main__":
    main()
