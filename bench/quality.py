"""What the CPU weight paths cost in quality: perplexity on held-out text, and agreement with the exact path.

Text (nothing downloaded): the news articles of the shipped Spec-Bench summarization prompts
(specserve/data/spec_bench, prose) and source files of this Python's own standard library (code), each
document's first --tokens tokens one chunk. Each chunk is one prefill with logits for every position;
perplexity = exp(mean negative log-likelihood of the next token). Variants, one model file (the default target's GGUF):
  dense        its weights dequantized to --dtype, torch matmuls (the reference)
  exact        GGUF blocks on the exact kernel path (SPECSERVE_INT8_DOT=0: weights expanded to float32)
  int8 dot     GGUF blocks on the integer path (the default: activations quantized to int8 per 32 inputs)
For each: perplexity per text, and against `dense`: the share of positions whose top-1 token agrees and the
mean KL(dense || variant) in nats.

With --llama-perplexity PATH (llama.cpp's tool, built by `python bench/peers.py setup` plus
`cmake --build <its build> --target llama-perplexity`), each kind's documents are also joined into one
text file and scored by llama.cpp's protocol, by that tool on the GGUF file and by us on every variant:
the whole text tokenized once, cut into windows of --tokens tokens, and only the second half of each
window scored (every scored token has at least half a window of context; no BOS: the model adds none).

    python bench/quality.py [--dtype float32] [--tokens 512] [--chunks 12] [--llama-perplexity PATH] [--label NAME]

Writes bench/results/quality/<label>.md and .json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sysconfig
import tempfile
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.benchmark.machine import cpu_model
from specserve.settings import settings

RESULTS = Path(__file__).parent / "results" / "quality"
STDLIB_FILES = ["json/decoder.py", "textwrap.py", "argparse.py", "dataclasses.py", "functools.py", "heapq.py",
                "shlex.py", "string.py", "fractions.py", "statistics.py", "csv.py", "difflib.py"]
VARIANTS = {"dense": (None, True), "exact": ("gguf", False), "int8 dot": ("gguf", True)}  # quantization, int8 dot


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
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], block, short_kernel=True)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), meta, kv)).float()


def llama_protocol_nll(model, ids: list[int], window: int) -> tuple[float, int]:
    """(sum of NLL, tokens scored) over whole windows of `ids`, each scoring its second half's next tokens."""
    nll, count, first = 0.0, 0, window // 2
    for start in range(0, len(ids) - window + 1, window):
        chunk = ids[start:start + window]
        logp = F.log_softmax(chunk_logits(model, chunk)[first:window - 1], dim=-1)
        nll -= logp.gather(1, torch.tensor(chunk[first + 1:])[:, None]).sum().item()
        count += window - 1 - first
    return nll, count


def llama_cpp_ppl(tool: str, gguf: str, text_file: str, window: int, threads: int) -> float:
    """llama-perplexity's final estimate on the file."""
    proc = subprocess.run([tool, "-m", gguf, "-f", text_file, "-c", str(window), "-b", str(window), "-t", str(threads)],
                          capture_output=True, text=True, timeout=3600)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stdout + proc.stderr)
    if found is None:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return float(found.group(1))


def evaluate_llama_protocol(args, models: dict, tokenizer, docs: dict) -> list[dict]:
    from specserve.model.registry import gguf_path
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind, documents in docs.items():
            path = Path(tmp) / "text.txt"
            joined = tokenizer.encode("\n\n".join(documents))  # its first --windows windows (and a little more)
            path.write_text(tokenizer.decode(joined[:(args.windows + 1) * args.tokens], skip_special_tokens=False))
            ids = tokenizer.encode(path.read_text())
            for name, model in models.items():
                nll, count = llama_protocol_nll(model, ids, args.tokens)
                out.append({"text": kind, "variant": name, "tokens": count, "ppl": math.exp(nll / count)})
            ppl = llama_cpp_ppl(args.llama_perplexity, str(gguf_path(args.model)), str(path), args.tokens, args.threads)
            out.append({"text": kind, "variant": "llama.cpp (llama-perplexity, the same GGUF)",
                        "tokens": count, "ppl": ppl})  # its windows are ours: the same text, the same tokenizer
            print(f"{kind}: llama.cpp protocol done", flush=True)
    return out


def evaluate(args) -> tuple[list[dict], list[dict]]:
    """(rows of the chunk protocol, rows of llama.cpp's protocol: none without --llama-perplexity)."""
    from specserve.model.loader import load_model
    from specserve.model.quantize import weight_summary
    docs = texts(args.chunks)
    models, summaries, default_int8_dot = {}, {}, settings.int8_dot
    for name, (quant, dot) in VARIANTS.items():
        settings.int8_dot = dot
        loaded = load_model(args.model, args.dtype, "cpu", quantization=quant)
        models[name], summaries[name] = loaded.model, weight_summary(loaded.model)
        tokenizer = loaded.tokenizer
        print(f"{name}: {summaries[name]}", flush=True)
    settings.int8_dot = default_int8_dot
    llama_rows = evaluate_llama_protocol(args, models, tokenizer, docs) if args.llama_perplexity else []
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
    return out, llama_rows


def table(rows: list[dict]) -> str:
    """Perplexity beside the dense model's on the same text; agreement and KL where the rows have them."""
    extra = "top1_agree" in rows[0]
    lines = ["| text | variant | tokens scored | perplexity | vs dense |"
             + (" top-1 agrees with dense | KL(dense ‖ variant), nats |" if extra else ""),
             "|---|---|---|---|---|" + ("---|---|" if extra else "")]
    for r in rows:
        dense = next(d for d in rows if d["text"] == r["text"] and d["variant"] == "dense")
        lines.append(f"| {r['text']} | {r['variant']} | {r['tokens']} | {r['ppl']:.3f} | "
                     f"{100 * (r['ppl'] / dense['ppl'] - 1):+.2f}% |"
                     + (f" {100 * r['top1_agree']:.1f}% | {r['kl']:.5f} |" if extra else ""))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=512, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=12, help="documents per text kind")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-perplexity", help="path of llama.cpp's llama-perplexity: also score by its protocol")
    p.add_argument("--windows", type=int, default=16, help="windows per text kind in llama.cpp's protocol")
    p.add_argument("--label", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    label = args.label or f"{datetime.date.today()}-{args.dtype}"
    rows, llama_rows = evaluate(args)
    cpu = cpu_model()
    md = (f"# Quality of the weight paths ({label})\n\n`python bench/quality.py {' '.join(os.sys.argv[1:])}`: "
          f"{args.model}, {args.dtype} activations, {cpu}, torch {torch.__version__}.\n\n{table(rows)}\n\n"
          "Weights: " + "; ".join(dict.fromkeys(f"{r['variant']}: {r['weights']}" for r in rows)) + "\n")
    if llama_rows:
        md += (f"\n## llama.cpp's protocol (windows of {args.tokens} tokens over the joined documents, second "
               f"halves scored)\n\n{table(llama_rows)}\n")
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{label}.json").write_text(json.dumps({"args": vars(args), "cpu": cpu, "rows": rows,
                                                       "llama_protocol": llama_rows}, indent=1))
    (RESULTS / f"{label}.md").write_text(md)
    print(f"wrote {RESULTS / label}.md and .json")


if __name__ == "__main__":
    main()
