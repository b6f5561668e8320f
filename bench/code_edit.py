"""Multi-turn code editing at one request at a time: prompt lookup vs suffix decoding vs the default.

    python bench/code_edit.py [--sessions 8] [--turns 3] [--max-tokens 320] [--repeats 3] [--label NAME]

Sessions from specserve/benchmark/code_edit.py (a standard-library function, then edits of it, each turn
carrying the history with the model's own replies). One engine per configuration (SmolLM2-135M-Instruct, 2
threads, greedy, prefix caching on), every session run turn by turn, one request at a time. Greedy output
is the same under every configuration (checked), so each one generates exactly the same tokens and only the
time differs. Configurations run in a shuffled order each repeat (interleaved); the table gives per
configuration the committed tokens per decode step (1 + accepted drafts per step, what each proposer's
drafts are worth), the time per output token after the first (decode) and the session time (prefills
included), as medians over repeats with their min-max, and each one's speed over plain decoding's and over
prompt lookup's. Results: bench/results/code_edit/<label>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.benchmark.code_edit import build_sessions
from specserve.benchmark.machine import git_commit
from specserve.spec_decode.config import DEFAULT_SPECULATIVE

OUT = Path(__file__).parent / "results" / "code_edit"
CONFIGS = {
    "none": None,
    "ngram k=8": {"method": "ngram", "num_speculative_tokens": 8},
    "suffix k=8": {"method": "suffix", "num_speculative_tokens": 8},
    "default": json.loads(DEFAULT_SPECULATIVE),
    # the server's default before suffix decoding, the Q8_0 drafts and the native draft chain
    "default-2026-11": {"model": "default", "num_speculative_tokens": 4, "ngram_first": True, "policy": "adaptive"},
}


def run_session(llm, messages: list[str], params: SamplingParams) -> dict:
    """Every turn of one session, one request at a time: tokens, decode steps, decode and total seconds."""
    engine, history = llm.engine, []
    out = {"tokens": 0, "steps": 0, "decode_s": 0.0, "total_s": 0.0, "replies": []}
    for message in messages:
        history.append({"role": "user", "content": message})
        engine.add_request(llm.tokenizer.encode_chat(history), params)
        t0, first, final = time.perf_counter(), None, None
        while engine.has_unfinished():
            for o in engine.step():
                final = o if o.finished else final
            if first is None and engine.last_stats.num_decodes == 0:
                continue  # prefill steps
            if first is None:
                first = time.perf_counter()
            out["steps"] += 1
        end = time.perf_counter()
        out["tokens"] += final.num_output_tokens
        out["decode_s"] += end - (first or end)
        out["total_s"] += end - t0
        out["replies"].append(final.token_ids)
        history.append({"role": "assistant", "content": final.text})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=320)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="none,ngram k=8,suffix k=8,default",
                   help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--label", default=datetime.date.today().isoformat())
    args = p.parse_args()
    names = args.configs.split(",")
    engines = {name: LLM(speculative_config=CONFIGS[name], num_threads=args.threads) for name in names}
    for name in names:
        if engines[name].engine.policy is not None and engines[name].engine.policy.uses_cost_model:
            engines[name].engine.profile_costs()
    sessions = build_sessions(args.sessions, args.turns, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = {name: [] for name in names}
    replies = {}
    for repeat in range(args.repeats):
        order = list(names)
        random.Random(repeat).shuffle(order)
        for name in order:
            llm = engines[name]
            llm.reset_prefix_cache()
            runs = [run_session(llm, messages, params) for messages in sessions]
            for s, r in enumerate(runs):
                if replies.setdefault(s, r["replies"]) != r["replies"]:
                    raise SystemExit(f"{name}: greedy output differs from another configuration's (session {s})")
            total = {key: sum(r[key] for r in runs) for key in ("tokens", "steps", "decode_s", "total_s")}
            rows[name].append(total)
            print(f"repeat {repeat} {name}: {total['tokens'] / total['steps']:.2f} tokens/step, "
                  f"{1e3 * total['decode_s'] / total['tokens']:.2f} ms/token, {total['total_s']:.1f} s", flush=True)
    table = report(rows, names, args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.md").write_text(table)
    (OUT / f"{args.label}.json").write_text(json.dumps({"args": vars(args), "commit": git_commit("?"), "rows": rows},
                                                       indent=1))
    print(table)


def report(rows: dict, names: list[str], args) -> str:
    def med(name, f):
        values = [f(r) for r in rows[name]]
        return statistics.median(values), min(values), max(values)

    per_token = {n: med(n, lambda r: 1e3 * r["decode_s"] / r["tokens"]) for n in names}
    session = {n: med(n, lambda r: r["total_s"] / args.sessions) for n in names}
    lines = [f"# Multi-turn code editing, one request at a time ({args.label})", "",
             f"`python bench/code_edit.py --sessions {args.sessions} --turns {args.turns} --max-tokens "
             f"{args.max_tokens} --repeats {args.repeats} --configs \"{','.join(names)}\"`, {args.threads} threads; "
             "medians over repeats (min-max).", "",
             "| config | tokens / decode step | ms / output token | speedup over none | over ngram k=8 | s / session |",
             "|---|---|---|---|---|---|"]
    for n in names:
        tps = med(n, lambda r: r["tokens"] / r["steps"])[0]
        t, lo, hi = per_token[n]
        over = lambda base: f"{per_token[base][0] / t:.2f}x" if base in per_token else "-"  # noqa: E731
        s, slo, shi = session[n]
        lines.append(f"| {n} | {tps:.2f} | {t:.2f} ({lo:.2f}-{hi:.2f}) | {over('none')} | {over('ngram k=8')} | "
                     f"{s:.2f} ({slo:.2f}-{shi:.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
