"""The latency model's mixture-of-experts term on our own server (issue 78, goal 3).

A random-weight Qwen3-MoE shape (default: Qwen3-30B-A3B's 128 experts with 8 active per token, its hidden
size, experts' width and layer count scaled down to this machine; transformers writes the checkpoint, the
server quantizes it to Q8_0 at load) is served plainly and speculating with a random-weight draft under
synthetic acceptance (`"rejection_sample_method": "synthetic"`, docs/design.md §4.5: random weights would
accept nothing), swept from a lone request towards saturation by `specserve bench sweep`, and fitted twice
by `specserve latency validate`: the dense form C = C1 + B·C2 and the MoE-aware one (`--moe 8/128`: every
coefficient an always-paid part plus coverage φ(T) = 1 − (1 − m/M)^T times an expert part). Held-out rate
errors are reported for the lower-load half of the rates and the upper half separately, as the paper does.

    python bench/moe_latency.py [--out runs/moe-latency] [--ks 2,4] [--acceptance-length 2.5]
        [--fractions 0.05,0.1,0.2,0.35,0.5,0.7] [--duration 60] [--skip-sweep]

Writes OUT/models (the checkpoints, reused), OUT/fixed.jsonl (the sweep), OUT/validate-dense.md,
OUT/validate-moe.md and OUT/summary.md (the low/high-load table). --skip-sweep refits existing results.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


def build_models(out: Path, args) -> tuple[Path, Path]:
    """The MoE target and a one-layer Llama draft over SmolLM2's tokenizer (so prompts have exact lengths),
    random weights; written once."""
    import torch
    import transformers

    from specserve.model.registry import fetch

    tokenizer_dir = fetch("smollm2-135m")
    target, draft = out / "moe-target", out / "draft"
    common = dict(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    specs = [(target, "Qwen3MoeForCausalLM", transformers.Qwen3MoeConfig(
                 hidden_size=args.hidden, moe_intermediate_size=args.moe_intermediate,
                 intermediate_size=args.moe_intermediate, num_hidden_layers=args.layers,
                 num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                 num_experts=args.experts, num_experts_per_tok=args.active, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, **common)),
             (draft, "LlamaForCausalLM", transformers.LlamaConfig(
                 hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, **common))]
    for path, arch, config in specs:
        if (path / "config.json").exists():
            continue
        torch.manual_seed(0)
        print(f"writing a random-weight {arch} to {path}", flush=True)
        getattr(transformers, arch)(config).save_pretrained(path)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_dir / name, path / name)
    return target, draft


def configs(args, target: Path, draft: Path) -> list[dict]:
    serve = (f"{sys.executable} -m specserve serve --model {target} --quantization q8_0 "
             f"--num-threads {args.threads} --max-model-len {args.max_model_len} --disable-access-log")
    out = [{"label": "no-sd", "k": 0, "launch": f"{serve} --speculative-config none"}]
    for k in args.ks:
        spec = json.dumps({"model": str(draft), "num_speculative_tokens": k, "quantization": "q8_0",
                           "rejection_sample_method": "synthetic",
                           "synthetic_acceptance_length": min(args.acceptance_length, k + 1)}).replace(" ", "")
        out.append({"label": f"k{k}", "k": k, "launch": f"{serve} --speculative-config {shlex.quote(spec)}"})
    for n, c in enumerate(out):
        c["base_url"] = f"http://127.0.0.1:{args.port + n}"
        c["launch"] += f" --port {args.port + n}"
    return out


def held_out_by_load(report) -> dict[str, float]:
    """Mean-E2E MAPE of the held-out rates, the lower-load half of the ranks and the upper half apart."""
    groups = report.cross_validation["rate"]["groups"]
    n = len(groups)
    errors = [g["mape"].get("e2e", {}).get("mape") for g in groups]
    low = [e for e in errors[:n // 2] if e is not None]
    high = [e for e in errors[n // 2:] if e is not None]
    overall = report.cross_validation["rate"]["overall"].get("e2e", {}).get("mape")
    return {"low": statistics.fmean(low) if low else float("nan"),
            "high": statistics.fmean(high) if high else float("nan"), "all": overall,
            "r2": report.model.e2e.coefficients.r2}


def summarize(out: Path, results: Path, moe: str) -> str:
    from specserve.latency.fitting.fit import FitOptions
    from specserve.latency.equations.moe import MoeExperts
    from specserve.latency.fitting.validate import markdown, validate_files

    active, experts = (int(x) for x in moe.split("/"))
    rows = []
    for name, options in (("dense form", FitOptions()),
                          (f"MoE-aware (--moe {moe})", FitOptions(moe=MoeExperts(active, experts)))):
        report = validate_files([results], options)
        (out / f"validate-{'moe' if options.moe else 'dense'}.md").write_text(markdown(report))
        rows.append((name, held_out_by_load(report)))
    lines = ["| fit | held-out rates, lower-load half | upper half | all | in-sample R² |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {r['low']:.2f}% | {r['high']:.2f}% | {r['all']:.2f}% | {r['r2']:.3f} |"
              for name, r in rows]
    ratio = rows[1][1]["low"] / rows[0][1]["low"]
    lines.append(f"\nMoE-aware / dense held-out error at low load: {ratio:.2f} (goal <= 0.5)")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/moe-latency"))
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--moe-intermediate", type=int, default=128, help="each expert's width")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--active", type=int, default=8, help="experts per token")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4])
    p.add_argument("--acceptance-length", type=float, default=2.5,
                   help="synthetic mean tokens per step at k drafts (capped at k + 1)")
    p.add_argument("--fractions", default="0.05,0.1,0.2,0.35,0.5,0.7")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds of arrivals per run")
    p.add_argument("--discard-first", type=float, default=15.0)
    p.add_argument("--requests-per-run", type=int, default=2000, help="a cap above what --duration sends")
    p.add_argument("--burstiness", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1, help="server torch threads (leave a core for the rest)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--port", type=int, default=8173)
    p.add_argument("--skip-sweep", action="store_true", help="refit the results already in --out")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    target, draft = build_models(args.out / "models", args)
    results = args.out / "fixed.jsonl"
    if not args.skip_sweep:
        config_file = args.out / "configs.json"
        config_file.write_text(json.dumps(configs(args, target, draft), indent=2))
        cmd = [sys.executable, "-m", "specserve", "bench", "sweep", "--configs", str(config_file),
               "--fractions", args.fractions, "--per-config-saturation", "--interleave",
               "--max-requests", str(args.requests_per_run), "--duration", str(args.duration),
               "--discard-first", str(args.discard_first), "--burstiness", str(args.burstiness),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len),
               "--tokenizer", str(target), "--no-progress", "--results", str(results),
               "--log-dir", str(args.out / "server_logs")]
        print("+", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode:  # 1: some run completed no request (fitting leaves it out)
            print("warning: the sweep reported runs that completed nothing", flush=True)
    table = summarize(args.out, results, f"{args.active}/{args.experts}")
    (args.out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
