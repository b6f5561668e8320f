"""Issue 4 benchmark: speculative decoding on SmolLM2-135M, batch 1 and under load.

Workloads: code (held-out CPython stdlib files: 200-token prefixes, 64 new tokens) and chat (Spec-Bench
prompts, chat template, 64 new tokens). Configurations: no SD, and for each of --methods and k = 1..8:
the draft model (`draft`), n-gram prompt lookup (`ngram`), or lookup where it finds a match and the
draft model elsewhere (`draft+ngram`, `"ngram_first": true`). Every prompt runs through every
configuration back to back (A/B interleaved), so a load spike on this shared machine hits all
configurations alike. Each configuration is its own engine (~0.7 GB with its KV cache).

Per configuration: output tokens/s and mean latency per request, acceptance rate, mean acceptance
length E (tokens committed per step that drafted), tokens per step over all steps (n-gram lookup drafts
nothing on some steps), and the speedup docs/design.md §2.2 predicts from the measured per-step costs:
tokens/step * T_dense / (T_verify(k) + T_draft(k)), with T_dense the mean plain decode step,
T_verify the mean target forward over k+1 tokens and T_draft the mean drafting time of a step.
Then the same k at batch 8 and 32 (all prompts submitted at once) to show how the speedup falls.

Workload `mixed` interleaves the code and chat prompts (one engine serving both) and compares the drafts
of --mixed-drafts on them: one shipped draft for all requests, or `default`, which drafts each request
with the draft matching its prompt (spec_decode/router.py) at the price of one draft forward per draft and
drafting step when a batch holds both kinds.

    python bench/spec_decode.py [--draft code|chat|DIR] [--code-prompts 40] [--chat-prompts 80] [--ks 1,2,...]
        [--methods draft,ngram,draft+ngram] [--workloads code,chat,mixed] [--mixed-drafts code,chat,default]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from specserve import LLM, SamplingParams


def code_prompts(tokenizer, n: int, prefix: int = 200, new: int = 64) -> list[list[int]]:
    from specserve.distill.corpus import read_texts, stdlib_files
    rng, out = random.Random(0), []
    for text in read_texts(stdlib_files("eval")):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= prefix + new:
            start = rng.randrange(0, len(ids) - prefix - new + 1)
            out.append(ids[start:start + prefix])
        if len(out) == n:
            break
    return out


def chat_prompts(tokenizer, n: int) -> tuple[list[list[int]], list[str]]:
    """n held-out Spec-Bench questions (never trained on by a shipped draft), chat-templated, round robin
    over the categories: the first question of each, then the second of each, ..."""
    from specserve.distill.corpus import SPEC_BENCH_HELD_OUT_PER_TASK
    from specserve.distill.evaluate import chat_prompts as held_out_by_category
    by_cat = held_out_by_category(tokenizer, SPEC_BENCH_HELD_OUT_PER_TASK)
    rows = [(qs[i], cat) for i in range(SPEC_BENCH_HELD_OUT_PER_TASK) for cat, qs in by_cat.items() if i < len(qs)]
    if n > len(rows):
        raise SystemExit(f"--chat-prompts: at most {len(rows)} held-out Spec-Bench questions, got {n}")
    return [ids for ids, _ in rows[:n]], [cat for _, cat in rows[:n]]


def method_specs(method: str, drafts: list[str]) -> list[tuple[str, dict]]:
    """(name, speculative config) of a method for each draft (n-gram lookup needs none)."""
    if method == "ngram":
        return [("ngram", {"method": "ngram"})]
    suffix = "+ngram" if method == "draft+ngram" else ""
    return [(f"draft:{d}{suffix}", {"model": d, "ngram_first": bool(suffix)}) for d in drafts]


class Config:
    def __init__(self, name: str, k: int, spec: dict | None, args):
        self.name, self.k = name, k
        # A fixed block count (~0.37 GiB for SmolLM2) rather than a memory fraction: one engine per
        # configuration lives at once, and batch 32 x (200 + 64 + 8) tokens needs ~580 blocks of 16.
        self.llm = LLM(model="smollm2-135m", dtype=args.dtype, num_threads=args.threads, num_kv_blocks=1024,
                       max_num_seqs=64, speculative_config=spec)
        self.reset()

    def reset(self):
        self.tokens = self.seconds = self.requests = 0
        self.drafts = self.draft_tokens = self.accepted = 0
        self.t_forward, self.t_draft, self.decode_slots = [], [], 0
        self.by_category: dict[str, list[int]] = {}

    def run(self, prompts: list[list[int]], new_tokens: int, categories: list[str] | None = None):
        """All prompts submitted together (batch = len(prompts)); per-step costs recorded."""
        engine = self.llm.engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            s = engine.last_stats
            self.decode_slots += s.num_decodes  # each decode/verify slot commits >= 1 token of a request
            if s.num_decodes and not s.num_prefill_tokens:  # pure decode/verify steps only
                self.t_forward.append(s.t_forward)
                self.t_draft.append(s.t_draft)
        self.seconds += time.perf_counter() - t0
        self.requests += len(prompts)
        for i, rid in enumerate(ids):
            o = done[rid]
            self.tokens += len(o.token_ids)
            self.drafts += o.spec["num_drafts"]
            self.draft_tokens += o.spec["num_draft_tokens"]
            self.accepted += o.spec["num_accepted_tokens"]
            if categories:
                c = self.by_category.setdefault(categories[i], [0, 0])
                c[0] += o.spec["num_drafts"]
                c[1] += o.spec["num_accepted_tokens"]

    @property
    def mean_acceptance_length(self) -> float:
        """E over the steps that drafted (n-gram lookup drafts nothing when it finds no match)."""
        return 1 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per decode/verify step over all steps (the first token of each request comes
        from its prefill): what the speedup formula needs when some steps draft nothing."""
        return (self.tokens - self.requests) / self.decode_slots if self.decode_slots else 1.0


def table(title: str, configs: list[Config], dense: Config) -> None:
    base_tps = dense.tokens / dense.seconds
    t_dense = statistics.mean(dense.t_forward)
    print(f"\n{title}")
    print("| config | k | tok/s | latency/request (s) | acceptance rate | E (drafting steps) | tokens/step (all steps) "
          "| speedup | predicted | measured/predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in configs:
        tps = c.tokens / c.seconds
        speedup = tps / base_tps
        if c.k:
            predicted = c.tokens_per_step * t_dense / (statistics.mean(c.t_forward) + statistics.mean(c.t_draft))
            rate = c.accepted / c.draft_tokens if c.draft_tokens else 0.0
            extra = (f"{rate:.2f} | {c.mean_acceptance_length:.2f} | {c.tokens_per_step:.2f} | {speedup:.2f}x | "
                     f"{predicted:.2f}x | {speedup / predicted:.0%}")
        else:
            extra = "- | 1.00 | 1.00 | 1.00x | - | -"
        print(f"| {c.name} | {c.k} | {tps:.1f} | {c.seconds / c.requests:.2f} | {extra} |")


def category_table(drafted: list[Config], cats: list[str]) -> None:
    if not drafted:  # --load-k not among --ks
        return
    print(f"\nchat, k = {drafted[0].k}: mean acceptance length E per Spec-Bench category")
    print("| category | " + " | ".join(c.name for c in drafted) + " |\n|---|" + "---|" * len(drafted))
    for cat in dict.fromkeys(cats):
        row = [f"{1 + c.by_category[cat][1] / max(1, c.by_category[cat][0]):.2f}" for c in drafted]
        print(f"| {cat} | " + " | ".join(row) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default="code", help="draft for the code workload (chat uses --chat-draft)")
    p.add_argument("--chat-draft", default="chat")
    p.add_argument("--code-prompts", type=int, default=40)
    p.add_argument("--chat-prompts", type=int, default=80)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--load-k", type=int, default=4, help="k for the batch 8 / 32 rows")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="code,chat")
    p.add_argument("--methods", default="draft,ngram,draft+ngram")
    p.add_argument("--mixed-drafts", default="code,chat,default", help="drafts compared on the mixed workload")
    args = p.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    dense = Config("no SD", 0, None, args)
    tokenizer = dense.llm.tokenizer
    for workload in args.workloads.split(","):
        drafts = {"code": [args.draft], "chat": [args.chat_draft], "mixed": args.mixed_drafts.split(",")}[workload]
        configs = [dense] + [Config(name, k, spec | {"num_speculative_tokens": k}, args)
                             for m in args.methods.split(",") for name, spec in method_specs(m, drafts) for k in ks]
        if workload == "code":
            prompts, cats = code_prompts(tokenizer, args.code_prompts), None
        elif workload == "chat":
            prompts, cats = chat_prompts(tokenizer, args.chat_prompts)
        else:  # code and chat alternating, so that every batch holds both
            code, chat = code_prompts(tokenizer, args.code_prompts), chat_prompts(tokenizer, args.chat_prompts)[0]
            prompts = [p for pair in zip(code, chat) for p in pair] + code[len(chat):] + chat[len(code):]
            cats = None
        for c in configs:
            c.reset()
        for i, prompt in enumerate(prompts):  # batch 1, interleaved across configurations
            for c in configs:
                c.run([prompt], args.new_tokens, [cats[i]] if cats else None)
        table(f"{workload}: batch 1, {len(prompts)} prompts x {args.new_tokens} new tokens, greedy, "
              f"{args.dtype}, {args.threads} threads", configs, dense)
        if cats:
            category_table([c for c in configs if c.k == args.load_k], cats)
        load = [c for c in configs if c.k in (0, args.load_k)]
        for b in [int(x) for x in args.batches.split(",")]:
            for c in load:
                c.reset()
            batch = (prompts * (b // len(prompts) + 1))[:b]
            for c in load:
                c.run(batch, args.new_tokens)
            table(f"{workload}: batch {b} (all submitted at once), k = {args.load_k}", load, dense)
        del configs, load  # free this workload's engines before the next one builds its own


if __name__ == "__main__":
    main()
