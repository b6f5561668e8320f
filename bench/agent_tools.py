"""An agent's multi-turn tool loop against a real server, through the official client: what prefix caching
does to its TTFT and what speculation does to its decode (issue 79's agent benchmark).

    python bench/agent_tools.py --sessions 8 --edits 3 --repeats 3 --name 2026-12-05   # ~10 min on 2 cores

A session edits one "file" (a Python function from the standard library's held-out files, as the code
benchmarks use) the way coding agents do: the user asks for an edit of the file; the agent calls
`read_file` (tool_choice naming it), gets the file's text back as a tool result, then calls `write_file`
with the whole new text (named again: the grammar makes the arguments valid JSON of the tool's schema);
the tool answers "written", and the user asks for the next edit, `--edits` in all (a call cut by
`--max-tokens` ends its session: its arguments are not a call to send back). Every request carries
the conversation so far, tool calls and results included, so each prompt extends the previous one: the
prefix cache serves all of it but the new turn, and the write_file arguments re-emit text the prompt
holds: what prompt lookup drafts for free.

Configurations, each its own server, started per round in a shuffled order (rounds use other sessions, so
nothing is cached from an earlier round): `default` (speculation and prefix caching on), `none`
(`--speculative-config none`), `default, no prefix cache` (`--no-enable-prefix-caching`). Greedy, so every
configuration writes the same calls (checked); requests stream, one at a time. Per configuration: the
median TTFT of the requests after a session's first (their prompts extend a cached one), the time per
output token after the first over write_file requests, the sessions' time, how many calls were cut, and
whether every other call's arguments validated against its tool's schema. Writes
bench/results/agent_tools/<name>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stress import start_server  # noqa: E402

from specserve.benchmark.code_edit import EDITS, stdlib_functions  # noqa: E402
from specserve.benchmark.machine import cpu_model, git_commit  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "agent_tools"
CONFIGS = {"default": "", "none": "--speculative-config none",
           "default, no prefix cache": "--no-enable-prefix-caching"}
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
                       "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace a file's text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SYSTEM = "You are a coding agent. Read a file before you change it; write back its whole new text."


def sessions(n: int, edits: int, seed: int) -> list[dict]:
    functions = [f for f in stdlib_functions() if f[2]]
    rng = np.random.default_rng([seed, 79])
    out = []
    for i in rng.integers(0, len(functions), n):
        source, name, params = functions[i]
        asks = [EDITS[j].format(name=name, param=params[int(rng.integers(len(params)))])
                for j in rng.permutation(len(EDITS))[:edits]]
        out.append({"path": f"{name}.py", "source": source, "asks": asks})
    return out


def call(client, model: str, messages: list, tool: str, max_tokens: int) -> dict:
    """One streamed request naming `tool`: its TTFT, time, output tokens and the call (id, arguments)."""
    t0 = time.perf_counter()
    ttft, call_id, args, usage, finish = None, None, "", None, None
    stream = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=max_tokens, stream=True,
        tool_choice={"type": "function", "function": {"name": tool}}, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                call_id = delta.id or call_id
                args += (delta.function.arguments or "") if delta.function else ""
            finish = choice.finish_reason or finish
    seconds = time.perf_counter() - t0
    try:
        jsonschema.validate(json.loads(args), SCHEMAS[tool])
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return dict(tool=tool, ttft=ttft if ttft is not None else seconds, seconds=seconds, arguments=args,
                tokens=usage.completion_tokens if usage else 0, prompt_tokens=usage.prompt_tokens if usage else 0,
                finish=finish, valid=valid, id=call_id or "call_0")


def run_session(client, model: str, s: dict, max_tokens: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    records = []

    def step(tool: str, result: str) -> bool:
        r = call(client, model, messages, tool, max_tokens)
        records.append(r)
        if r["finish"] == "length":  # arguments cut short: not a call to send back (the session ends)
            return False
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": r["id"], "type": "function", "function": {"name": tool, "arguments": r["arguments"]}}]})
        messages.append({"role": "tool", "tool_call_id": r["id"], "content": result})
        return True

    for e, ask in enumerate(s["asks"]):
        messages.append({"role": "user", "content": f"In {s['path']}: {ask}"})
        if (e == 0 and not step("read_file", s["source"])) or not step("write_file", "written"):
            break
    return records


def summarize(rows: list[dict]) -> dict:
    later = [r["ttft"] for r in rows if r["turn"] > 0]
    writes = [r for r in rows if r["tool"] == "write_file" and r["tokens"] > 1]
    tpot = [(r["seconds"] - r["ttft"]) / (r["tokens"] - 1) for r in writes]
    return dict(ttft_later_ms=1000 * statistics.median(later), ttft_first_ms=1000 * statistics.median(
        r["ttft"] for r in rows if r["turn"] == 0), tpot_ms=1000 * statistics.mean(tpot),
        session_s=sum(r["seconds"] for r in rows), valid=sum(r["valid"] for r in rows), calls=len(rows),
        cut=sum(r["finish"] == "length" for r in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--edits", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--name", default=datetime.date.today().isoformat())
    args = ap.parse_args()
    args.max_num_seqs, args.max_queue = 8, 100  # start_server's
    rounds = []  # per round, per config: every request's record
    for repeat in range(args.repeats):
        work = sessions(args.sessions, args.edits, seed=repeat)
        order = list(CONFIGS)
        random.Random(repeat).shuffle(order)
        for config in order:
            args.server_args = CONFIGS[config]
            proc, url = start_server(args, Path("/tmp/agent_tools_server.log"))
            try:
                client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=600)
                client.chat.completions.create(model=args.model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4)  # warm-up: a server's first request pays more
                rows = []
                for i, s in enumerate(work):
                    records = run_session(client, args.model, s, args.max_tokens)
                    rows += [dict(r, session=i, turn=t) for t, r in enumerate(records)]
            finally:
                proc.terminate()
                proc.wait(60)
            rounds.append(dict(repeat=repeat, config=config, rows=rows, **summarize(rows)))
            print(f"r{repeat} {config:24} " + ", ".join(f"{k} {v:.2f}" for k, v in summarize(rows).items()),
                  flush=True)
    same = all(len({tuple(r["arguments"] for r in x["rows"]) for x in rounds if x["repeat"] == rep}) == 1
               for rep in range(args.repeats))
    write(args, rounds, same)


def write(args, rounds: list[dict], same: bool) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    command = "python bench/agent_tools.py " + " ".join(sys.argv[1:])

    def med(config, key):
        values = [r[key] for r in rounds if r["config"] == config]
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    lines = [f"# An agent's tool loop ({args.name})", "",
             f"`{command}`: {cpu_model()}, commit {git_commit('?')}; {args.sessions} sessions of {args.edits} edits "
             f"a round (read_file once, write_file per edit), {args.repeats} rounds; medians over rounds "
             f"(min-max). Greedy: every configuration wrote the same calls: {'yes' if same else 'NO'}.", "",
             "| config | TTFT, first request ms | TTFT, later requests ms | write_file ms / output token | "
             "s / round | calls: valid / all (cut by max_tokens) |", "|---|---|---|---|---|---|"]
    for config in CONFIGS:
        valid = sum(r["valid"] for r in rounds if r["config"] == config)
        calls = sum(r["calls"] for r in rounds if r["config"] == config)
        cut = sum(r["cut"] for r in rounds if r["config"] == config)
        lines.append(f"| {config} | {med(config, 'ttft_first_ms')} | {med(config, 'ttft_later_ms')} | "
                     f"{med(config, 'tpot_ms')} | {med(config, 'session_s')} | {valid} / {calls} ({cut}) |")
    (OUT / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    (OUT / f"{args.name}.json").write_text(json.dumps(dict(command=command, cpu=cpu_model(), commit=git_commit("?"),
                                                           same_calls=same, rounds=rounds), indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
