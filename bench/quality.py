"""What the CPU weight paths cost in quality: perplexity on held-out text, and agreement with the exact path.

Text (nothing downloaded): the news articles of the shipped Spec-Bench summarization prompts
(specserve/data/spec_bench, prose) and source files of this Python's own standard library (code), cut into chunks of --tokens tokens. Each chunk
is one prefill with logits for every position; perplexity = exp(mean negative log-likelihood of the next
token). Variants, one model file (the default target's GGUF):
  dense        its weights dequantized to --dtype, torch matmuls (the reference)
  exact        GGUF blocks on the exact kernel path (SPECSERVE_INT8_DOT=0: weights expanded to float32)
  int8 dot     GGUF blocks on the integer path (the default: activations quantized to int8 per 32 inputs)
For each: perplexity per text, and against `dense`: the share of positions whose top-1 token agrees and the
mean KL(dense || variant) in nats.

    python bench/quality.py [--dtype float32] [--tokens 512] [--chunks 12] [--label NAME]

Writes bench/results/quality/<label>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sysconfig
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results" / "quality"
STDLIB_FILES = ["json/decoder.py", "textwrap.py", "argparse.py", "dataclasses.py", "functools.py", "heapq.py",
                "shlex.py", "string.py", "fractions.py", "statistics.py", "csv.py", "difflib.py"]
VARIANTS = {"dense": (None, "1"), "exact": ("gguf", "0"), "int8 dot": ("gguf", "1")}  # quantization, INT8_DOT


def texts(chunks: int) -> dict[str, list[str]]:
    """A few long documents per kind; chunks are cut from their tokens later."""
    lines = (resources.files("specserve") / "data" / "spec_bench" / "question.jsonl").read_text().splitlines()
    articles = [row["turns"][0].removeprefix("Summarize: ") for row in map(json.loads, lines)
                if row["category"] == "summarization" and len(row["turns"][0]) > 2000]
    lib = Path(sysconfig.get_paths()["stdlib"])
    code = [(lib / name).read_text() for name in STDLIB_FILES[:chunks] if (lib / name).exists()]
    return {"prose (Spec-Bench news articles)": articles[:chunks], "code (Python stdlib)": code}


def chunk_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one prefill over ids (a fresh cache)."""
    from specserve.model.attention import AttentionMetadata, allocate_kv_cache
    c, block = model.config, 16
    blocks = -(-len(ids) // block)
    kv = allocate_kv_cache(c.num_hidden_layers, blocks, block, c.num_key_value_heads, c.head_dim,
                           next(model.parameters()).dtype)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], block,
                                   sliding_window=c.sliding_window, short_kernel=True)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), meta, kv)).float()


def evaluate(args) -> list[dict]:
    from specserve.model.loader import load_model
    from specserve.model.quantize import weight_summary
    docs = texts(args.chunks)
    models, summaries = {}, {}
    for name, (quant, dot) in VARIANTS.items():
        os.environ["SPECSERVE_INT8_DOT"] = dot
        loaded = load_model(args.model, args.dtype, "cpu", quantization=quant)
        models[name], summaries[name] = loaded.model, weight_summary(loaded.model)
        tokenizer = loaded.tokenizer
        print(f"{name}: {summaries[name]}", flush=True)
    os.environ.pop("SPECSERVE_INT8_DOT")
    out = []
    for kind, documents in docs.items():
        nll = {n: 0.0 for n in models}
        agree = {n: 0 for n in models}
        kl = {n: 0.0 for n in models}
        count = 0
        for doc in documents:
            ids = tokenizer.encode(doc)[:args.tokens]
            if len(ids) < 2:
                continue
            target = torch.tensor(ids[1:])
            ref = F.log_softmax(chunk_logits(models["dense"], ids)[:-1], dim=-1)
            for name, model in models.items():
                logp = ref if name == "dense" else F.log_softmax(chunk_logits(model, ids)[:-1], dim=-1)
                nll[name] -= logp.gather(1, target[:, None]).sum().item()
                agree[name] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
                kl[name] += (ref.exp() * (ref - logp)).sum().item()
            count += len(target)
        print(f"{kind}: {count} tokens", flush=True)
        for name in models:
            out.append({"text": kind, "variant": name, "tokens": count, "ppl": math.exp(nll[name] / count),
                        "top1_agree": agree[name] / count, "kl": kl[name] / count, "weights": summaries[name]})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| text | variant | tokens | perplexity | vs dense | top-1 agrees with dense | KL(dense ‖ variant), nats |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        dense = next(d for d in rows if d["text"] == r["text"] and d["variant"] == "dense")
        lines.append(f"| {r['text']} | {r['variant']} | {r['tokens']} | {r['ppl']:.3f} | "
                     f"{100 * (r['ppl'] / dense['ppl'] - 1):+.2f}% | {100 * r['top1_agree']:.1f}% | {r['kl']:.5f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=512, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=12, help="documents per text kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--label", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    label = args.label or f"{datetime.date.today()}-{args.dtype}"
    rows = evaluate(args)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    md = (f"# Quality of the weight paths ({label})\n\n`python bench/quality.py {' '.join(os.sys.argv[1:])}`: "
          f"{args.model}, {args.dtype} activations, {cpu}, torch {torch.__version__}.\n\n{table(rows)}\n\n"
          "Weights: " + "; ".join(dict.fromkeys(f"{r['variant']}: {r['weights']}" for r in rows)) + "\n")
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{label}.json").write_text(json.dumps({"args": vars(args), "cpu": cpu, "rows": rows}, indent=1))
    (RESULTS / f"{label}.md").write_text(md)
    print(f"wrote {RESULTS / label}.md and .json")


if __name__ == "__main__":
    main()
