"""GPU throughput of specserve on random-weight models built from configs (no download), as issue 64 measures it.

    python bench/gpu.py --out bench/results/gpu/RUN            # every shape, batch 1 and 32, off / n-gram / adaptive
    python bench/gpu.py --variants before,after --before .before   # also an older checkout's package, same card

Each (variant, shape) runs in its own process: `after` is this checkout (CUDA graphs), `eager` the same with
--enforce-eager, `before` and `previous` the packages found under --before and --previous (e.g. `git archive
<commit> specserve | tar -x -C .before`).
Per speculative config one engine serves a batch of 1, then a batch of 32 (so the adaptive policy
meets both levels in one life: the two-level load), each prompt 256 random tokens, 128 new tokens, greedy,
EOS ignored. It prints tok/s, steps, tokens per step, and writes rows.jsonl (with each phase's mean ms per
step); `--profile` adds the share of a batch-32 step the GPU is busy (torch.profiler: kernel time over wall
time), `--identity` checks greedy output in float32 with and without speculation. `--repeats N` runs each
(variant, shape) N times, interleaved, for the spread (`--once` names variants run in the first repeat only);
`--host-profile` writes the host's busiest functions during the batch-32 plain run (cProfile, `after`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # Hugging Face configs of the two shapes (random weights; rope scaling left out: shape, not quality)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
}
CONFIGS = {"off": None, "ngram-k4": {"method": "ngram", "num_speculative_tokens": 4, "policy": "static"},
           "adaptive": {"method": "ngram", "num_speculative_tokens": 4, "policy": "adaptive"}}


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_model(shape: str, folder: Path, device: str) -> Path:
    """A model directory of `shape` with random bf16 weights (std 0.02) and SmolLM2's tokenizer."""
    import torch
    from specserve.model.config import ModelConfig
    from specserve.model.llama import LlamaModel
    from specserve.model.weights import hf_state_dict, save_hf_weights
    folder.mkdir(parents=True, exist_ok=True)
    hf = dict(SHAPES[shape], architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5,
              max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, hidden_act="silu")
    torch.manual_seed(0)
    model = LlamaModel(ModelConfig.from_hf(hf), device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.02)
    save_hf_weights({k: v.to(torch.bfloat16).cpu() for k, v in hf_state_dict(model).items()}, folder)
    (folder / "config.json").write_text(json.dumps(hf))
    tok = ROOT / "specserve" / "drafts" / "chat" / "tokenizer.json"
    (folder / "tokenizer.json").write_bytes(tok.read_bytes())
    return folder


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random
    rng = random.Random(seed)
    return [[rng.randrange(3, min(vocab, 49152)) for _ in range(length)] for _ in range(n)]


PHASES = ("schedule", "draft", "forward", "sample", "other")
VARIANTS = ("before", "previous", "eager", "after")


def package_root(args, variant: str | None) -> Path:
    """Where a variant's `specserve` package is imported from."""
    folder = {"before": args.before, "previous": args.previous}.get(variant)
    return Path(folder).resolve() if folder else ROOT


def generate(engine, batch: list[list[int]], params, phases: dict | None = None) -> tuple[float, int, int]:
    """(seconds, steps, tokens) to finish `batch` on `engine` (LLMEngine), stepping it ourselves; `phases`
    gets each phase's mean ms per step (the engine's StepStats: on a GPU the forward on the device's clock)."""
    for p in batch:
        engine.add_request(p, params)
    sync()
    t0, steps, tokens = time.perf_counter(), 0, 0
    sums = dict.fromkeys(PHASES, 0.0)
    prefill_steps, prefill_s, last = 0, 0.0, t0
    while engine.has_unfinished():
        tokens += sum(len(o.delta_token_ids) for o in engine.step())
        steps += 1
        for name in PHASES:
            sums[name] += getattr(engine.last_stats, "t_" + name)
        now = time.perf_counter()
        if engine.last_stats.num_prefill_tokens:  # wall time of the steps that prefill (host clock, after sync)
            prefill_steps, prefill_s = prefill_steps + 1, prefill_s + now - last
        last = now
    sync()
    seconds = time.perf_counter() - t0
    if phases is not None:
        phases.update({name: round(1e3 * v / steps, 3) for name, v in sums.items()},
                      step=round(1e3 * seconds / steps, 3), prefill_steps=prefill_steps,
                      prefill_ms=round(1e3 * prefill_s, 2))
    return seconds, steps, tokens


def worker(args) -> None:
    """One (variant, shape): every config, batch 1 then 32 on one engine each; rows appended to --rows."""
    import torch
    from specserve.engine.llm import LLM
    from specserve.engine.sampling_params import SamplingParams
    vocab = SHAPES[args.shape]["vocab_size"]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for name in args.configs.split(","):
        kwargs = dict(dtype="bfloat16", device=args.device, max_num_seqs=64, speculative_config=CONFIGS[name])
        if args.variant == "eager":
            kwargs["enforce_eager"] = True
        t0 = time.perf_counter()
        llm = LLM(args.model_dir, **kwargs)
        start_s = time.perf_counter() - t0
        for b in (1, 32):  # warm-up: compile kernels, capture the graphs of both levels
            generate(llm.engine, prompts(b, args.prompt_len, vocab, seed=99), warm)
        for batch in map(int, args.batches.split(",")):
            phases = {}
            seconds, steps, tokens = generate(llm.engine, prompts(batch, args.prompt_len, vocab, seed=batch), params,
                                              phases)
            row = dict(variant=args.variant, shape=args.shape, config=name, batch=batch, repeat=args.repeat,
                       seconds=seconds, steps=steps, tokens=tokens, tok_s=tokens / seconds, startup_s=start_s,
                       phases_ms=phases,
                       device=torch.cuda.get_device_name() if args.device == "cuda" else args.device)
            if args.profile and batch == 32:
                row["gpu_busy"] = gpu_busy(llm.engine, prompts(32, args.prompt_len, vocab, seed=7), params)
            if args.host_profile and batch == 32 and name == "off":  # a run of its own: cProfile slows the host
                host_profile(llm.engine, prompts(32, args.prompt_len, vocab, seed=8), params,
                             Path(args.rows).parent / "host_profile.txt", args.shape)
            print(json.dumps(row), flush=True)
            with open(args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")
        del llm
        torch.cuda.empty_cache()


def host_profile(engine, batch, params, path: Path, shape: str) -> None:
    """Appends to `path` the host functions that took the most time themselves while `batch` runs (cProfile
    slows the host: read the shares, not the milliseconds)."""
    import cProfile
    import io
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    generate(engine, batch, params)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    with open(path, "a") as f:
        f.write(f"## {shape}, batch 32, plain decoding (cProfile, sorted by own time)\n{text.getvalue()}\n")


def gpu_busy(engine, batch, params) -> float:
    """Kernel time over wall time while `batch` runs (the profiler's own overhead lowers it a little)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, _, _ = generate(engine, batch, params)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.device_time_total for e in kernels if e.device_time_total > 0 and "Memcpy" not in e.name)
    return busy_us / 1e6 / seconds


def identity(model_dir: str, out: Path, device: str) -> dict:
    """Greedy token ids in float32 on the GPU: plain decoding (eager and graphs) against n-gram k=4 static and
    adaptive. Returns how many of the sequences agree token for token."""
    from specserve.engine.llm import LLM
    from specserve.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    batch = prompts(8, 64, 49152, seed=3)
    ids = {}
    for name, kwargs in [("off-eager", dict(enforce_eager=True)), ("off", {}),
                         ("ngram-k4", dict(speculative_config=CONFIGS["ngram-k4"])),
                         ("adaptive", dict(speculative_config=CONFIGS["adaptive"]))]:
        llm = LLM(model_dir, dtype="float32", device=device, **kwargs)
        ids[name] = [o.token_ids for o in llm.generate(batch, params)]
        del llm
    result = {name: sum(a == b for a, b in zip(ids["off-eager"], v)) for name, v in ids.items()}
    (out / "identity.json").write_text(json.dumps(dict(agree_of_8=result, ids=ids)))
    return result


def table(rows: list[dict]) -> str:
    """Median tok/s over repeats (min-max with several), tokens per step, GPU busy, the two-level load."""
    import statistics
    by: dict[tuple, list[dict]] = {}
    # GPU busy comes from a profiled run of its own (--profile), valid whatever the row's timing
    busy_by = {(r["shape"], r["config"], r["batch"]): r["gpu_busy"] for r in rows if "gpu_busy" in r}
    for r in rows:
        if not r.get("host_profiled"):  # timed under cProfile (runs before the profile ran on its own): left out
            by.setdefault((r["variant"], r["shape"], r["config"], r["batch"]), []).append(r)
    variants = sorted({r["variant"] for r in rows}, key=VARIANTS.index)

    def tok_s(key) -> str:
        values = [r["tok_s"] for r in by.get(key, [])]
        if not values:
            return "-"
        spread = f" ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else ""
        return f"{statistics.median(values):,.0f}{spread}"
    lines = ["| shape | batch | config | " + " | ".join(f"{v} tok/s" for v in variants) + " | tokens/step (last)"
             " | step ms: all / forward on the GPU (last) | prefill steps: ms (last) | GPU busy |",
             "|---" * (7 + len(variants)) + "|"]
    for shape, config, batch in sorted({k[1:] for k in by}, key=lambda k: (k[0], k[2], list(CONFIGS).index(k[1]))):
        last = by.get((variants[-1], shape, config, batch), [{}])[0]
        per_step = f"{last['tokens'] / last['steps'] / batch:.2f}" if last else "-"
        busy = f"{busy_by[shape, config, batch]:.0%}" if (shape, config, batch) in busy_by else "-"
        ph = last.get("phases_ms") or {}
        step = f"{ph['step']:.2f} / {ph['draft'] + ph['forward']:.2f}" if "step" in ph else "-"
        prefill = f"{ph['prefill_steps']}: {ph['prefill_ms']:.1f}" if "prefill_ms" in ph else "-"
        cells = " | ".join(tok_s((v, shape, config, batch)) for v in variants)
        lines.append(f"| {shape} | {batch} | {config} | {cells} | {per_step} | {step} | {prefill} | {busy} |")
    for v in variants:  # the two-level load: batch 1 then batch 32 on one engine, total time (medians)
        for shape in sorted({k[1] for k in by}):
            total = {c: sum(statistics.median(r["seconds"] for r in by[v, shape, c, b]) for b in (1, 32))
                     for c in CONFIGS if all((v, shape, c, b) in by for b in (1, 32))}
            if total:
                lines.append(f"two-level ({v}, {shape}): " + ", ".join(f"{c} {s:.2f} s" for c, s in total.items()))
    return "\n".join(lines)


def write_meta(out: Path, args) -> None:
    """What the run was: its command and the commits it compared (this checkout's: `git_commit`, which takes
    $SPECSERVE_COMMIT on a device; <before>/COMMIT and <previous>/COMMIT name the older packages')."""
    from specserve.benchmark.machine import git_commit
    commit = git_commit("?")
    before, previous = Path(args.before) / "COMMIT", Path(args.previous) / "COMMIT"
    meta = dict(command="python bench/gpu.py " + " ".join(sys.argv[1:]), commit=commit,
                before_commit=before.read_text().strip() if before.exists() else None,
                previous_commit=previous.read_text().strip() if previous.exists() else None,
                date=time.strftime("%Y-%m-%dT%H:%M:%S"))
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu/run")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--variants", default="after", help=", ".join(VARIANTS) + " (comma-separated)")
    p.add_argument("--before", default=".before", help="folder holding the older `specserve` package")
    p.add_argument("--previous", default=".previous", help="folder holding a second older `specserve` package")
    p.add_argument("--once", default="", help="variants run in the first repeat only (comma-separated)")
    p.add_argument("--host-profile", action="store_true", help="cProfile of the batch-32 plain run (after)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="GPU busy share of the batch-32 run (after only)")
    p.add_argument("--identity", action="store_true", help="float32 greedy identity with and without speculation")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (default: %(default)s)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=1, help="runs of each (variant, shape), interleaved")
    p.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--shape", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--rows", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(package_root(args, args.variant) if args.worker else ROOT))
    if args.worker:
        return worker(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_meta(out, args)
    rows_path = out / "rows.jsonl"
    models = Path(tempfile.mkdtemp(prefix="specserve-gpu-"))
    if args.identity:
        try:
            print("identity (sequences of 8 equal to eager plain decoding):",
                  identity(str(make_model("smollm2-135m", models / "identity", args.device)), out, args.device),
                  flush=True)
        except Exception as e:  # a lent GPU's minutes: report it and measure the rest
            print(f"identity check failed: {type(e).__name__}: {e}", flush=True)
    for shape in args.shapes.split(","):
        model_dir = make_model(shape, models / shape, args.device)
        for repeat in range(args.repeats):
            for variant in args.variants.split(","):
                if repeat and variant in args.once.split(","):
                    continue
                env = dict(os.environ, PYTHONPATH=str(package_root(args, variant)))
                cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--shape", shape,
                       "--model-dir", str(model_dir), "--rows", str(rows_path), "--configs", args.configs,
                       "--batches", args.batches, "--prompt-len", str(args.prompt_len), "--repeat", str(repeat),
                       "--new-tokens", str(args.new_tokens), "--device", args.device, "--before", args.before,
                       "--previous", args.previous]
                if args.profile and variant == "after" and repeat == 0:
                    cmd.append("--profile")
                if args.host_profile and variant == "after" and repeat == 0:
                    cmd.append("--host-profile")
                code = subprocess.call(cmd, env=env)
                if code:
                    print(f"worker {variant} {shape} exited {code}", flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    text = table(rows)
    (out / "table.md").write_text(f"card: {rows[0]['device'] if rows else '?'}\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
