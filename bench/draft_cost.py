"""What one draft token costs, as a fraction of a plain decode step, at 1, 4 and 16 requests.

    python bench/draft_cost.py [--batches 1,4,16] [--repeats 3] [--drafts "chat q8_0,chat"]

For each batch size N: N MT-Bench chat requests decode together (greedy, 96 tokens forced, one engine each):
plain decoding, and the EAGLE draft at a static k = 1 and k = 4 (every request drafts k tokens every step).
A draft step drafts one token for each of the N requests. Reported per N: the plain step (target forward
and sampling, median over steps), the draft phase at k = 1 and k = 4, and one draft step as a share of the
plain step: on average over the k = 4 chain ((draft at k = 4) / 4) and at the margin ((k=4 - k=1) / 3: a
chain's later steps, without the first step's catch-up of the positions the target accepted). Engines run
in a shuffled order each repeat; medians over repeats with the min-max. Results: bench/results/draft_cost/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.benchmark.machine import git_commit
from specserve.benchmark.prompts import load_dataset

OUT = Path(__file__).parent / "results" / "draft_cost"


def measure(llm, prompts: list[list[int]], k: int) -> dict:
    """Median phase times (s) of the decode steps where every request drafted k tokens (k = 0: plain)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    draft, plain = [], []
    while engine.has_unfinished():
        engine.step()
        s = engine.last_stats
        if s.num_decodes == len(prompts) and not s.num_prefill_tokens and sum(s.draft_lengths) == k * len(prompts):
            draft.append(s.t_draft)
            plain.append(s.t_forward + s.t_sample)
    return {"draft": statistics.median(draft), "step": statistics.median(plain), "steps": len(plain)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafts", default="chat q8_0,chat", help="comma-separated: a shipped draft and its weights")
    p.add_argument("--label", default=datetime.date.today().isoformat())
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [d.split() for d in args.drafts.split(",")]
    engines = {("none", 0): LLM(num_threads=args.threads, max_num_seqs=64)}
    for draft in drafts:
        for k in (1, 4):
            spec = {"method": "eagle", "model": draft[0], "num_speculative_tokens": k, "policy": "static",
                    **({"quantization": draft[1]} if len(draft) > 1 else {})}
            engines[(" ".join(draft), k)] = LLM(speculative_config=spec, num_threads=args.threads, max_num_seqs=64)
    questions = load_dataset("mt-bench")
    tok = engines[("none", 0)].tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in questions[:max(batches)]]
    runs = {(key, n): [] for key in engines for n in batches}
    for repeat in range(args.repeats):
        order = list(runs)
        random.Random(repeat).shuffle(order)
        for key, n in order:
            llm = engines[key]
            llm.reset_prefix_cache()
            runs[(key, n)].append(measure(llm, prompts[:n], key[1]))
            print(f"repeat {repeat} {key} N={n}: {runs[(key, n)][-1]}", flush=True)
    table = report(runs, drafts, batches, args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.md").write_text(table)
    (OUT / f"{args.label}.json").write_text(json.dumps(
        {"args": vars(args), "commit": git_commit("?"),
         "runs": [{"engine": list(key), "batch": n, "repeats": r} for (key, n), r in runs.items()]}, indent=1))
    print(table)


def report(runs: dict, drafts: list[list[str]], batches: list[int], args) -> str:
    def med(values):
        return statistics.median(values), min(values), max(values)

    lines = [f"# One draft token against a plain step ({args.label})", "",
             f"`python bench/draft_cost.py --batches {args.batches} --repeats {args.repeats} "
             f"--drafts \"{args.drafts}\"`, {args.threads} threads; ms, medians over repeats (min-max); "
             "shares per repeat.", "",
             "| draft | requests | plain step | draft, k = 1 | draft, k = 4 "
             "| a draft step / plain step (k = 4 average) | at the margin ((k4 - k1) / 3) |",
             "|---|---|---|---|---|---|---|"]
    for draft in drafts:
        name = " ".join(draft)
        for n in batches:
            plain = [r["step"] for r in runs[(("none", 0), n)]]
            one = [r["draft"] for r in runs[((name, 1), n)]]
            four = [r["draft"] for r in runs[((name, 4), n)]]
            average = med([f / 4 / p for f, p in zip(four, plain)])
            margin = med([(f - o) / 3 / p for f, o, p in zip(four, one, plain)])
            ms = lambda v: "{:.2f} ({:.2f}-{:.2f})".format(*(1e3 * x for x in med(v)))  # noqa: E731
            lines.append(f"| {name} | {n} | {ms(plain)} | {ms(one)} | {ms(four)} | "
                         f"{average[0]:.1%} ({average[1]:.1%}-{average[2]:.1%}) | "
                         f"{margin[0]:.1%} ({margin[1]:.1%}-{margin[2]:.1%}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
