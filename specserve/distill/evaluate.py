"""Acceptance of a draft with our engine (greedy, tokens per verify step) and its cost relative to the
target. Used by bench/draft_acceptance.py, by tests, and by anyone checking a freshly distilled draft."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from specserve.distill import corpus
from specserve.distill.replies import chat_prompt


def code_prompts(tokenizer, n: int, prefix_tokens: int = 200, new_tokens: int = 64, seed: int = 0) -> list[list[int]]:
    """`prefix_tokens`-token prefixes of held-out stdlib files (never trained on), one per file, starting at
    a seeded line start inside the file so prompts are not all license headers and imports."""
    rng = np.random.default_rng(seed)
    out = []
    for text in corpus.read_texts(corpus.stdlib_files("eval")):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < prefix_tokens + new_tokens:
            continue
        start = int(rng.integers(0, len(ids) - prefix_tokens - new_tokens + 1))
        out.append(ids[start:start + prefix_tokens])
        if len(out) == n:
            break
    return out


def chat_prompts(tokenizer, per_category: int) -> dict[str, list[list[int]]]:
    """The first `per_category` Spec-Bench first-turn questions of every category, chat-templated (held-out
    questions only: at most 10 per category)."""
    if not 1 <= per_category <= corpus.SPEC_BENCH_HELD_OUT_PER_TASK:
        raise ValueError(f"per_category must be 1..{corpus.SPEC_BENCH_HELD_OUT_PER_TASK} (the held-out Spec-Bench "
                         f"questions), got {per_category}")
    by_cat: dict[str, list[list[int]]] = defaultdict(list)
    for q in corpus.spec_bench_questions("eval"):
        if len(by_cat[q["category"]]) < per_category:
            by_cat[q["category"]].append(tokenizer.encode_chat([{"role": "user", "content": q["text"]}]))
    return dict(by_cat)


def sharegpt_prompts(tokenizer, n: int, max_prompt_tokens: int = 256) -> list[list[int]]:
    """The first n held-out ShareGPT prompts (never trained on; the chat draft's own distribution), cut to
    `max_prompt_tokens` as in training, chat-templated."""
    return [chat_prompt(tokenizer, p, max_prompt_tokens) for p in corpus.sharegpt_prompts("eval")[:n]]


def tokens_per_step(outputs) -> float:
    """Mean acceptance length over requests: 1 + accepted / drafts (vLLM's definition)."""
    drafts = sum(o.spec["num_drafts"] for o in outputs)
    accepted = sum(o.spec["num_accepted_tokens"] for o in outputs)
    return 1 + accepted / drafts if drafts else float("nan")


def position_acceptance(outputs, k: int) -> list[float]:
    """P(draft position i is accepted) for i = 1..k, over all drafting steps: position i counts only when
    positions 1..i-1 were accepted too, so the list is non-increasing and sums to tokens_per_step - 1."""
    drafts = sum(o.spec["num_drafts"] for o in outputs)
    accepted = [0] * k
    for o in outputs:
        for i, n in enumerate(o.spec["accepted_per_position"][:k]):
            accepted[i] += n
    return [a / drafts if drafts else float("nan") for a in accepted]


def teacher_forced_agreement(target, draft, vocab_map, sequences: list[list[int]],
                             prompt_lens: list[int]) -> dict[str, float]:
    """An EAGLE draft's step 1 on the target's exact features of `sequences` (prompt + reply; no engine, no
    cache): top-1 agreement with the target's greedy next token at prompt and at reply positions. Next to the
    engine's acceptance at draft position 1 on the same replies, it tells what the draft cannot predict
    from what the serving path loses. target, draft: LlamaModel (the draft reading the target's
    embedding); vocab_map [draft vocab] target id of each head row, or None."""
    import torch

    from specserve.distill.eagle_draft import draft_passes, previous_features, target_argmax
    from specserve.distill.student import bf16_autocast
    from specserve.distill.teacher import PAD, shard_to, teach_features
    windows = np.full((len(sequences), max(map(len, sequences))), PAD, dtype=np.int64)
    for i, seq in enumerate(sequences):
        windows[i, :len(seq)] = seq
    device = draft.lm_head.weight.device
    shard = shard_to(teach_features(target, windows), device)
    greedy = target_argmax(target, shard)                    # [N, T] target's next token after position j
    hits, totals = {"prompt": 0, "reply": 0}, {"prompt": 0, "reply": 0}
    with torch.no_grad(), bf16_autocast(shard["features"]):
        for start in range(0, len(sequences), 8):
            ids = shard["tokens"][start:start + 8].long().clamp_min(0)
            out = draft_passes(draft, ids, previous_features(shard["features"][start:start + 8].float()), 1)[0]
            pred = draft.lm_head(out).argmax(-1)             # [n, T] the draft's guess at the same token
            pred = pred if vocab_map is None else vocab_map[pred]
            for row, i in enumerate(range(start, start + len(ids))):
                same = pred[row] == greedy[i]
                # Row j guesses token j + 1. Reply rows: from the first reply token (the engine drafts after
                # it) to the one before the last (the last has nothing to guess).
                n, m = prompt_lens[i], len(sequences[i])
                for part, (a, b) in (("prompt", (0, n - 1)), ("reply", (n, m - 1))):
                    hits[part] += int(same[a:b].sum())
                    totals[part] += b - a
    return {part: hits[part] / totals[part] if totals[part] else float("nan") for part in hits}


def acceptance(llm, prompts: list[list[int]], max_tokens: int = 64) -> float:
    from specserve import SamplingParams
    return tokens_per_step(llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                ignore_eos=True)))


def forward_flops(config, context: int) -> float:
    """Multiply-adds x 2 of one decode token at `context` tokens of KV: the matmuls (projections, MLP,
    head over its rows; the embedding is a lookup, a low-rank one adds its projection, an EAGLE draft its fc
    over [embedding; target feature]) plus attention."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    attention = 2 * q * context  # scores + weighted sum
    head = (c.draft_vocab_size or c.vocab_size) * c.hidden_size
    embed = (c.embedding_rank or 0) * c.hidden_size + (2 * c.hidden_size ** 2 if c.eagle else 0)
    return 2.0 * (c.num_hidden_layers * (per_layer + attention) + head + embed)
