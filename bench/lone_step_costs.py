"""Why the adaptive policy drafts short at one request: per draft length, what a decode step measured and what
the step cost model predicted, and the drafting-error factor the policy charges drafts with.

    python bench/lone_step_costs.py [--prompts 4] [--max-tokens 256] [--label NAME]   # ~2 min here

Prompt lookup alone under the adaptive policy (`{"method": "ngram", "num_speculative_tokens": 4, "policy":
"adaptive"}`), offline `LLM`, 2 threads, greedy, one request at a time over held-out standard-library code
prefixes (lone_request.py's code prompts). Every decode-only step the engine feeds its cost models with is
recorded: drafted tokens, the measured forward + sampling time, the predicted one, and the predicted time of
the same step without drafts. Prints, per drafted length, the steps, median measured and predicted ms, the
forward alone, and the lengths the policy chose against the lookup hit's length. Results:
bench/results/lone_step_costs/<label>.md.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import statistics
from pathlib import Path

from specserve import LLM, SamplingParams
from specserve.benchmark.machine import cpu_model, git_commit
from specserve.benchmark.prompts import load_dataset

OUT = Path(__file__).parent / "results" / "lone_step_costs"
CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "policy": "adaptive"}'


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--label", default=datetime.date.today().isoformat())
    args = p.parse_args()
    llm = LLM(speculative_config=CONFIG, num_threads=2)
    llm.engine.profile_costs()
    models, policy = llm.engine.models, llm.engine.policy
    steps, choices = [], collections.Counter()
    observe, plan = models.observe, policy.plan

    def observed(feedback):  # the step as the cost models see it, and their prediction before learning from it
        drafted = feedback.num_verify_tokens - len(feedback.outcomes)
        plain = float(models.cost.verify_time(len(feedback.outcomes), feedback.forward_kv - drafted)[0])
        predicted = observe(feedback)
        if not feedback.num_prefill_tokens and predicted is not None:
            t = feedback.times
            steps.append((drafted, 1000 * (t.forward + t.sample), 1000 * predicted, 1000 * plain, 1000 * t.forward))
        return predicted

    def planned(batch):
        lengths = plan(batch)
        choices[(batch.requests[0].max_drafts, lengths[0])] += 1
        return lengths

    models.observe, policy.plan = observed, planned
    prompts = [llm.tokenizer.encode(t)[:256] for t in load_dataset("python-stdlib")[::7][:args.prompts]]
    for prompt in prompts:
        llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0))
    lines = [f"# Decode steps by draft length, prompt lookup + adaptive, one request ({args.label})", "",
             f"`python bench/lone_step_costs.py --prompts {args.prompts} --max-tokens {args.max_tokens}`: "
             f"{cpu_model()}, commit {git_commit('?')}; medians per drafted length.", "",
             "| drafted | steps | measured ms (forward + sampling) | predicted ms | predicted without drafts | "
             "forward ms |", "|---|---|---|---|---|---|"]
    for length in sorted({s[0] for s in steps}):
        rows = [s for s in steps if s[0] == length]
        med = [statistics.median(r[i] for r in rows) for i in (1, 2, 3, 4)]
        lines.append(f"| {length} | {len(rows)} | " + " | ".join(f"{v:.2f}" for v in med) + " |")
    lines += ["", f"Drafting-error factor at the end: {models.drafting.factor:.2f} (the policy charges the time "
              "drafting adds that many times).", "",
              "Lengths chosen against the lookup hit's length (hit, chosen: plans):",
              ", ".join(f"({hit}, {n}): {c}" for (hit, n), c in sorted(choices.items()))]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
