"""Which grammar engine for structured output: llguidance or xgrammar, measured on our tokenizer.

For each of the 40 JSONSchemaBench schemas in bench/data/jsonschemabench (function-call argument schemas with
a valid instance each), both engines compile the schema, then walk the instance's tokens: at every position
the next-token mask over the model's vocabulary is computed and the token consumed, as a decoding step does;
at the end the walk rolls back 4 tokens and recomputes (what rejected drafts cost). Printed: compile time,
mask time per token (median, p99, max: the tail is what stalls a batch), consume time, and whether the
instance was accepted. One thread; run on an idle machine.

    python bench/grammar_backends.py --name 2026-11-29   # -> bench/results/structured_output/backends-<name>.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specserve.benchmark.machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "bench" / "data" / "jsonschemabench" / "glaive40.jsonl"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        self.lib = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_ids)

    def compile(self, schema: dict):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        return self.lib.LLMatcher(self.tokenizer, grammar)

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)

    def consume(self, matcher, token: int) -> bool:
        return matcher.consume_token(token) and not matcher.is_error()

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import transformers
        import xgrammar
        self.lib = xgrammar
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
        info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab_size,
                                                       stop_token_ids=tokenizer.eos_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.lib.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)), max_rollback_tokens=64)

    def fill(self, matcher, mask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(mask.view(1, -1))

    def consume(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)


def walk(backend, schema: dict, tokens: list[int], vocab_size: int) -> dict:
    mask = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    t0 = time.perf_counter()
    matcher = backend.compile(schema)
    compile_s = time.perf_counter() - t0
    mask_s, consume_s, ok = [], [], True
    for token in tokens:
        t0 = time.perf_counter()
        backend.fill(matcher, mask)
        t1 = time.perf_counter()
        allowed = bool((mask[token // 32] >> (token % 32)) & 1)
        ok = ok and allowed and backend.consume(matcher, token)
        consume_s.append(time.perf_counter() - t1)
        mask_s.append(t1 - t0)
        if not ok:
            break
    if ok and len(tokens) > 4:
        backend.rollback(matcher, 4)
        t0 = time.perf_counter()
        backend.fill(matcher, mask)
        mask_s.append(time.perf_counter() - t0)
        ok = bool((mask[tokens[-4] // 32] >> (tokens[-4] % 32)) & 1)
    return {"compile_s": compile_s, "mask_s": mask_s, "consume_s": consume_s, "accepted": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--name", help="write bench/results/structured_output/backends-NAME.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from specserve.model.loader import load_model
    loaded = load_model(args.model, "float32", "cpu")
    tokenizer, vocab = loaded.tokenizer, loaded.config.vocab_size
    rows = [json.loads(line) for line in SCHEMAS.read_text().splitlines()]
    # The instance as a model writes it (", " and ": "), each engine's default JSON whitespace allows it.
    cases = [(r["schema"], tokenizer.encode(json.dumps(r["example"]), add_special_tokens=False)) for r in rows]
    cpu = cpu_model()
    report = {"cpu": cpu, "model": args.model, "vocab_size": vocab,
              "schemas": len(cases), "backends": {}}
    print(f"{len(cases)} schemas, {sum(len(t) for _, t in cases)} instance tokens, vocabulary {vocab}")
    print(f"{'engine':<11} {'setup s':>8} {'compile ms (median/max)':>24} {'mask us (median/p99/max)':>26} "
          f"{'consume us':>11} {'accepted':>9}")
    for make in (LLGuidance, XGrammar):
        t0 = time.perf_counter()
        backend = make(tokenizer, vocab)
        setup = time.perf_counter() - t0
        for schema, tokens in cases[:2]:  # warm caches and lazy initialisation
            walk(backend, schema, tokens, vocab)
        walks = [walk(backend, schema, tokens, vocab) for schema, tokens in cases]
        masks = sorted(s for w in walks for s in w["mask_s"])
        compiles = sorted(w["compile_s"] for w in walks)
        consumes = [s for w in walks for s in w["consume_s"]]
        row = {"setup_s": setup, "compile_ms_median": 1e3 * statistics.median(compiles),
               "compile_ms_max": 1e3 * compiles[-1], "mask_us_median": 1e6 * statistics.median(masks),
               "mask_us_p99": 1e6 * masks[int(0.99 * (len(masks) - 1))], "mask_us_max": 1e6 * masks[-1],
               "consume_us_median": 1e6 * statistics.median(consumes),
               "accepted": sum(w["accepted"] for w in walks), "masks": len(masks)}
        report["backends"][backend.name] = row
        print(f"{backend.name:<11} {setup:8.2f} {row['compile_ms_median']:11.2f} / {row['compile_ms_max']:8.1f}   "
              f"{row['mask_us_median']:7.1f} / {row['mask_us_p99']:7.1f} / {row['mask_us_max']:7.0f}   "
              f"{row['consume_us_median']:9.1f} {row['accepted']:6d}/{len(walks)}")
    if args.name:
        out = ROOT / "bench" / "results" / "structured_output" / f"backends-{args.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
