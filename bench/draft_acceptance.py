"""Issue 5 table: acceptance of the shipped (or given) drafts for SmolLM2-135M-Instruct with our engine,
greedy, k = 4, on held-out data, and each draft's cost relative to the target.

Workloads: code = 200-token prefixes of held-out CPython stdlib files, 64 new tokens; chat = Spec-Bench
first-turn questions in the chat template, 64 new tokens, per category; --sharegpt N adds N held-out
ShareGPT prompts, the chat draft's own distribution (how much of the chat gap is the benchmark's shift).
Tokens per step = 1 + accepted / drafts, and the acceptance of each draft position (where the drafted
tokens are lost). Cost ratio (FLOPs) = draft / target forward FLOPs of one decode token at 264 tokens of
context.
--timing adds wall-clock numbers at batch 1 (run it on an idle machine): per-token forward time of draft
and target, and plain vs speculative decoding tokens/s on the code prompts. --teacher-forced runs each
EAGLE draft's first step on the target's exact features of the same prompts and replies, without the engine.

    python bench/draft_acceptance.py [--drafts code chat] [--code-prompts 40] [--per-category 5] [--timing]
        [--teacher-forced] [--sharegpt 48]
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from specserve import LLM, SamplingParams
from specserve.distill import evaluate
from specserve.model.loader import load_model
from specserve.spec_decode.drafts import resolve_drafts
from specserve.spec_decode.draft_loader import load_vocab_map, share_target_embedding

TARGET = "smollm2-135m"


def decode_step_seconds(model_dir: str, steps: int = 64, context: int = 264) -> float:
    """Median time of a batch-1 decode forward of a model over its paged cache at ~`context` tokens."""
    from specserve.engine.model_runner import ForwardItem, ModelRunner
    m = load_model(model_dir, "bfloat16")
    block = 16
    blocks = (context + steps) // block + 2
    runner = ModelRunner(m.model, blocks, block)
    table = list(range(blocks))
    # An EAGLE draft also reads a target hidden state per token (values do not matter for timing).
    feats = (lambda n: torch.randn(n, m.config.hidden_size, dtype=torch.bfloat16)) if m.config.eagle else (lambda n: None)
    runner.forward([ForwardItem(list(range(1, context + 1)), context, table, 1)], feats(context))
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        runner.forward([ForwardItem([5], context + i + 1, table, 1)], feats(1))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def stored_parameters(model_dir: str) -> int:
    """Parameters in the draft's safetensors (the engine's packed copies are not module parameters; an
    EAGLE draft stores no embedding: it reads the target's)."""
    from safetensors import safe_open
    with safe_open(f"{model_dir}/model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def generation_rate(llm, prompts, max_tokens: int = 64) -> float:
    """Tokens/s of generating every prompt alone (batch 1)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0, n = time.perf_counter(), 0
    for p in prompts:
        n += len(llm.generate([p], params)[0].token_ids)
    return n / (time.perf_counter() - t0)


def teacher_forced(target, name: str, workloads: dict) -> dict:
    """workload -> (prompts, engine outputs): `evaluate.teacher_forced_agreement` on prompt + greedy reply."""
    dirs = resolve_drafts(name)
    if len(dirs) > 1:  # routed drafts: each serves only its own requests; run them by name instead
        return {}
    draft = load_model(dirs[0], "float32")
    if not draft.config.eagle:
        return {}
    share_target_embedding(draft.model, target)
    vocab_map = load_vocab_map(draft, target.config.vocab_size)
    return {w: evaluate.teacher_forced_agreement(target, draft.model, vocab_map,
                                                 [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)],
                                                 [len(p) for p in prompts])
            for w, (prompts, outs) in workloads.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", nargs="+", default=["code", "chat"], help="shipped names or directories")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--code-prompts", type=int, default=40)
    ap.add_argument("--per-category", type=int, default=5, help="Spec-Bench questions per category")
    ap.add_argument("--sharegpt", type=int, default=0,
                    help="also N held-out ShareGPT prompts: the chat draft's training distribution, not the benchmark")
    ap.add_argument("--timing", action="store_true", help="also measure wall-clock cost (idle machine)")
    ap.add_argument("--teacher-forced", action="store_true",
                    help="also run each EAGLE draft's step 1 on the target's exact features of the same prompts and "
                         "greedy replies, without the engine (what the draft cannot predict vs what serving loses)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantizations", default="none",
                    help="comma-separated: the drafts' weights as loaded (none = as stored, q8_0, q4_0, q4_1); each "
                         "draft is measured under each")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    plain = LLM(model=TARGET, num_threads=args.threads)
    tok = plain.tokenizer
    code = evaluate.code_prompts(tok, args.code_prompts)
    chat = evaluate.chat_prompts(tok, args.per_category)
    chat_all = [p for cat in chat for p in chat[cat]]
    sharegpt = evaluate.sharegpt_prompts(tok, args.sharegpt) if args.sharegpt else []
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    # The target in bf16, as distillation teaches it (its features are what the drafts learned to read).
    teacher = load_model(TARGET, "float32").model.to(torch.bfloat16) if args.teacher_forced else None
    rows = {}
    quantizations = args.quantizations.split(",")
    columns = [(d, q) for d in args.drafts for q in quantizations]
    for draft, quantization in columns:
        name = draft if quantizations == ["none"] else f"{draft} {quantization}"
        spec = {"model": draft, "num_speculative_tokens": args.k}
        if quantization != "none":
            spec["quantization"] = quantization
        llm = LLM(model=TARGET, speculative_config=spec, num_threads=args.threads)
        outs = {"code": llm.generate(code, params)}
        print(f"{name} code: {evaluate.tokens_per_step(outs['code']):.2f}", file=sys.stderr, flush=True)
        for cat, prompts in chat.items():
            outs[cat] = llm.generate(prompts, params)
            print(f"{name} {cat}: {evaluate.tokens_per_step(outs[cat]):.2f}", file=sys.stderr, flush=True)
        if sharegpt:
            outs["sharegpt (held-out)"] = llm.generate(sharegpt, params)
        res = {w: evaluate.tokens_per_step(o) for w, o in outs.items()}
        chat_outs = [o for cat in chat for o in outs[cat]]  # in the order of chat_all
        res["chat (all)"] = evaluate.tokens_per_step(chat_outs)
        # workload -> (prompts, outputs), for the per-position and teacher-forced tables
        pooled = {"code": (code, outs["code"]), "chat (all)": (chat_all, chat_outs),
                  **({"sharegpt (held-out)": (sharegpt, outs["sharegpt (held-out)"])} if sharegpt else {})}
        res["_positions"] = {w: evaluate.position_acceptance(o, args.k) for w, (_, o) in pooled.items()}
        if args.teacher_forced:
            res["_teacher_forced"] = teacher_forced(teacher, name, pooled)
        proposer = llm.engine.proposer  # routed drafts (e.g. "default"): the first one's size and cost
        if hasattr(proposer, "choose"):  # per draft, in the order listed: requests routed, mean share kept
            for w, prompts in (("code", code), ("chat (all)", chat_all)):
                routes = [proposer.choose(p) for p in prompts]
                kept = torch.tensor([proposer.coverage(p) for p in prompts]).mean(dim=0).tolist()
                res.setdefault("_routes", {})[w] = [(routes.count(i), kept[i]) for i in range(len(kept))]
        draft_model = getattr(proposer, "proposers", [proposer])[0].runner.model
        res["_params"] = stored_parameters(resolve_drafts(draft)[0])
        res["_flops"] = evaluate.forward_flops(draft_model.config, 264)
        rows[name] = res
        del llm
    args.drafts = list(rows)  # the table's columns: each draft, under each quantization
    t_flops = evaluate.forward_flops(plain.engine.model_config, 264)
    workloads = ["code", "chat (all)"] + list(chat) + (["sharegpt (held-out)"] if sharegpt else [])
    print(f"\nTokens per verify step (greedy, k = {args.k}, 64 new tokens): code = {len(code)} held-out stdlib "
          f"prefixes of 200 tokens; chat = {args.per_category} Spec-Bench questions per category\n")
    print("| workload | " + " | ".join(args.drafts) + " |")
    print("|---|" + "---|" * len(args.drafts))
    for w in workloads:
        print(f"| {w} | " + " | ".join(f"{rows[d][w]:.2f}" for d in args.drafts) + " |")
    for d in args.drafts:
        for w, per_draft in rows[d].get("_routes", {}).items():
            print(f"{d} routes the {sum(n for n, _ in per_draft)} {w} prompts: " + ", ".join(
                f"{n} to its draft {i + 1} (keeps {kept:.1%} of their tokens on average)"
                for i, (n, kept) in enumerate(per_draft)))
    print("\nWhere the drafted tokens are lost: P(draft position i accepted) over all drafting steps, and in "
          "brackets the same given that position i - 1 was accepted")
    print("| draft | workload | " + " | ".join(f"position {i}" for i in range(1, args.k + 1)) + " |")
    print("|---|---|" + "---|" * args.k)
    for d in args.drafts:
        for w, probs in rows[d]["_positions"].items():
            cells = [f"{p:.3f} ({p / prev:.2f})" if prev else "-" for p, prev in zip(probs, [1.0] + probs[:-1])]
            print(f"| {d} | {w} | " + " | ".join(cells) + " |")
    if args.teacher_forced:
        print("\nThe same replies teacher-forced (no engine): the draft's step-1 top-1 agreement with the target on "
              "the target's exact features, next to the engine's acceptance at draft position 1")
        print("| draft | workload | prompt rows | reply rows | engine, position 1 |")
        print("|---|---|---|---|---|")
        for d in args.drafts:
            for w, tf in rows[d].get("_teacher_forced", {}).items():
                print(f"| {d} | {w} | {tf['prompt']:.3f} | {tf['reply']:.3f} | {rows[d]['_positions'][w][0]:.3f} |")
    print("\n| draft | parameters | FLOP cost ratio (draft / target, one decode token at 264 context) |")
    print("|---|---|---|")
    for d in args.drafts:
        params = rows[d]["_params"]
        print(f"| {d} | {params / 1e6:.1f}M | {rows[d]['_flops'] / t_flops:.3f} |")
    if args.timing:
        from specserve.model.registry import resolve
        t_step = decode_step_seconds(str(resolve(TARGET)))
        print(f"\nWall clock at batch 1 (bf16, {args.threads} threads): target decode forward {t_step * 1e3:.1f} ms")
        base = generation_rate(plain, code[:8])
        print(f"plain decoding on 8 code prompts: {base:.1f} tok/s")
        for (draft, quantization), d in zip(columns, args.drafts):
            d_step = decode_step_seconds(resolve_drafts(draft)[0])
            spec = {"model": draft, "num_speculative_tokens": args.k,
                    **({"quantization": quantization} if quantization != "none" else {})}
            llm = LLM(model=TARGET, speculative_config=spec, num_threads=args.threads)
            sd = generation_rate(llm, code[:8])
            print(f"{d}: draft forward (as stored) {d_step * 1e3:.2f} ms = {d_step / t_step:.3f} of the target; "
                  f"speculative decoding {sd:.1f} tok/s = {sd / base:.2f}x plain")


if __name__ == "__main__":
    main()
