"""Greedy bf16 output with speculation and under preemption against plain decoding (issue 45's identity).

Generates --max-tokens greedy tokens (EOS ignored) for --prompts Spec-Bench prompts (cut to 400
characters) with plain decoding, then with each configuration below, and counts the outputs identical to
plain decoding's. A KV cache of --blocks blocks forces preemptions (each recomputed by prefill); the
count of preemptions is printed. Set SPECSERVE_BATCH_INVARIANT=0 to compare with the non-invariant path.

    python bench/greedy_identity.py [--prompts 8] [--max-tokens 64] [--blocks 40] [--threads 1]
"""
from __future__ import annotations

import argparse
import json
from importlib import resources

from specserve import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--blocks", type=int, default=40, help="KV blocks of 16 tokens for the preemption runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", default=None)
    args = p.parse_args()
    rows = [json.loads(line) for line in
            (resources.files("specserve") / "data" / "spec_bench" / "question.jsonl").read_text().splitlines()]
    prompts = [r["turns"][0][:400] for r in rows[::max(1, len(rows) // args.prompts)][:args.prompts]]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    tight = dict(num_kv_blocks=args.blocks, max_model_len=args.blocks * 16 - 40)

    def run(**kw) -> tuple[list[list[int]], int]:
        llm = LLM(model="smollm2-135m", dtype="bfloat16", num_threads=args.threads,
                  quantization=args.quantization, **kw)
        ids = [llm.tokenizer.encode_chat([{"role": "user", "content": text}]) for text in prompts]
        outs = [o.token_ids for o in llm.generate(ids, params)]
        return outs, llm.engine.scheduler.num_preemptions

    base, _ = run()
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}}
    draft = {"speculative_config": {"model": "default", "num_speculative_tokens": 3}}
    configs = {"ngram k=4": ngram, "draft k=3": draft, "preemption": tight, "preemption + ngram k=4": tight | ngram,
               "preemption + draft k=3": tight | draft}
    print("| configuration | identical to plain decoding | preemptions |\n|---|---|---|")
    for name, kw in configs.items():
        outs, preempted = run(**kw)
        print(f"| {name} | {sum(a == b for a, b in zip(outs, base))} of {len(base)} | {preempted} |", flush=True)


if __name__ == "__main__":
    main()
