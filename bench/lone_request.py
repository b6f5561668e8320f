"""A lone request with natural outputs: each speculative config against plain decoding, on code and on chat.

    python bench/lone_request.py [--prompts 8] [--max-tokens 256] [--repeats 3] [--configs none,default]

Code: completions of --prompts held-out standard-library prefixes (python-stdlib, 256 tokens); chat: MT-Bench
first turns in the chat template. Greedy, EOS ends a reply (natural lengths), one request at a time, offline
`LLM` (SmolLM2-135M-Instruct Q4_1 on the int8 kernels, 2 threads). One engine per config; each repeat runs
the configs in a shuffled order (interleaved), and greedy outputs are checked identical across configs, so
every config generates the same tokens. Per workload and config: committed tokens per decode step, the
decode time per output token (after the first: TPOT) and its speedup over `none`, medians over repeats with
the min-max. Results: bench/results/lone_request/<label>.md and .json.
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
from specserve.benchmark.machine import git_commit
from specserve.benchmark.prompts import load_dataset
from specserve.spec_decode.config import DEFAULT_SPECULATIVE

OUT = Path(__file__).parent / "results" / "lone_request"
CONFIGS = {
    "none": None,
    "default": DEFAULT_SPECULATIVE,
    # the server's default before suffix decoding, the Q8_0 drafts and the native draft chain
    "default-2026-11": '{"model": "default", "num_speculative_tokens": 4, "ngram_first": true, "policy": "adaptive"}',
    "ngram k=4": '{"method": "ngram", "num_speculative_tokens": 4}',
    "suffix k=4": '{"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_spec_factor": 4}',
}


def workloads(llm, n: int) -> dict[str, list[list[int]]]:
    code = [llm.tokenizer.encode(t)[:256] for t in load_dataset("python-stdlib")[::7][:n]]
    chat = [llm.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in load_dataset("mt-bench")[:n]]
    return {"code": code, "chat": chat}


def decode(llm, prompt: list[int], params: SamplingParams) -> tuple[list[int], int, float]:
    """One request alone: its tokens, its decode steps and the seconds after its first token."""
    engine = llm.engine
    engine.add_request(prompt, params)
    first, steps, final = None, 0, None
    while engine.has_unfinished():
        for out in engine.step():
            final = out if out.finished else final
        if first is None:
            first = time.perf_counter()  # the prefill step produced the first token
            continue
        steps += 1
    return final.token_ids, steps, time.perf_counter() - first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--configs", default="none,default", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    p.add_argument("--label", default=datetime.date.today().isoformat())
    args = p.parse_args()
    names = args.configs.split(",")
    engines = {name: LLM(speculative_config=CONFIGS[name], num_threads=args.threads) for name in names}
    for llm in engines.values():
        if llm.engine.policy is not None and llm.engine.policy.uses_cost_model:
            llm.engine.profile_costs()
    prompts = workloads(engines[names[0]], args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    rows = {w: {name: [] for name in names} for w in prompts}
    outputs = {}
    for repeat in range(args.repeats):
        for workload, ps in prompts.items():
            order = list(names)
            random.Random(f"{repeat}{workload}").shuffle(order)
            for name in order:
                llm = engines[name]
                llm.reset_prefix_cache()
                tokens = steps = 0
                seconds = 0.0
                for i, prompt in enumerate(ps):
                    out, n, s = decode(llm, prompt, params)
                    if outputs.setdefault((workload, i), out) != out:
                        raise SystemExit(f"{name}: greedy output differs from another config's ({workload} {i})")
                    tokens, steps, seconds = tokens + len(out) - 1, steps + n, seconds + s
                rows[workload][name].append({"tokens": tokens, "steps": steps, "seconds": seconds})
                print(f"repeat {repeat} {workload} {name}: {tokens / steps:.2f} tokens/step, "
                      f"{1e3 * seconds / tokens:.2f} ms/token", flush=True)
    table = report(rows, names, args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.md").write_text(table)
    (OUT / f"{args.label}.json").write_text(json.dumps({"args": vars(args), "commit": git_commit("?"),
                                                        "configs": {n: CONFIGS[n] for n in names}, "rows": rows},
                                                       indent=1))
    print(table)


def report(rows: dict, names: list[str], args) -> str:
    lines = [f"# A lone request, natural outputs ({args.label})", "",
             f"`python bench/lone_request.py --prompts {args.prompts} --max-tokens {args.max_tokens} --repeats "
             f"{args.repeats} --configs {','.join(names)}`, {args.threads} threads, greedy, EOS allowed; "
             "medians over repeats (min-max); speedup: none's ms/token over the config's, per repeat.", "",
             "| workload | config | tokens / decode step | ms / output token | speedup over none |",
             "|---|---|---|---|---|"]
    for workload, by_name in rows.items():
        for name in names:
            runs = by_name[name]
            ms = [1e3 * r["seconds"] / r["tokens"] for r in runs]
            tps = statistics.median(r["tokens"] / r["steps"] for r in runs)
            cell = "-"
            if "none" in by_name:
                ratios = [1e3 * b["seconds"] / b["tokens"] / m for b, m in zip(by_name["none"], ms)]
                cell = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
            lines.append(f"| {workload} | {name} | {tps:.2f} | {statistics.median(ms):.2f} ({min(ms):.2f}-"
                         f"{max(ms):.2f}) | {cell} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
