"""Where a batch-1 token goes, in-process: the engine's phase times per step, grouped by the step's draft length.

    python bench/batch1_phases.py [--configs "none;default;JSON"] [--prompts 4] [--tokens 128]

For each speculative config (JSON, `none`, or `default`: the server's default), one LLM (default model, greedy,
EOS ignored) generates --tokens tokens for each of --prompts python-stdlib prefixes of 256 tokens, one request at
a time; per prompt it prints the time per output token after the first, the number of steps, and for each draft
length k the steps' median draft, target-forward, sampling and scheduling (policy planning) times in ms.
Prints only (an instrument for diagnosis, not a result: docs/experiments/engine-kernels-adaptive-2026-11.md quotes it).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

from specserve.benchmark.prompts import load_dataset
from specserve.engine.llm import LLM
from specserve.engine.sampling_params import SamplingParams
from specserve.spec_decode.config import DEFAULT_SPECULATIVE


def run(config: str, prompts: int, tokens: int) -> None:
    llm = LLM(speculative_config=DEFAULT_SPECULATIVE if config == "default" else config)
    engine, texts = llm.engine, load_dataset("python-stdlib")
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for i in range(prompts):
        engine.add_request(llm.tokenizer.encode(texts[i * 7])[:256], params)
        first, by_k = None, collections.defaultdict(list)
        while engine.has_unfinished():
            engine.step()
            if first is None:  # the prefill step: TPOT counts from the first token on
                first = time.perf_counter()
                continue
            s = engine.last_stats
            by_k[sum(s.draft_lengths)].append((s.t_draft, s.t_forward, s.t_sample, s.t_schedule))
        tpot = (time.perf_counter() - first) / (tokens - 1)
        ms = lambda rows, j: 1e3 * statistics.median(r[j] for r in rows)  # noqa: E731
        phases = "  ".join(f"k={k}: {len(v)} steps, draft {ms(v, 0):.1f} fwd {ms(v, 1):.1f} sample {ms(v, 2):.2f} "
                           f"schedule {ms(v, 3):.2f}" for k, v in sorted(by_k.items()))
        print(f"{config} prompt {i}: TPOT {1e3 * tpot:.1f} ms, {sum(map(len, by_k.values())) + 1} steps | {phases}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="none;default", help="';'-separated speculative configs")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    for config in args.configs.split(";"):
        run(config, args.prompts, args.tokens)


if __name__ == "__main__":
    main()
