"""Issue 3 benchmark: specserve vs transformers on 64 ShareGPT prompts x 128 output tokens (ignore EOS).

Systems (each run in its own subprocess, so peak RSS is its own; runs interleaved A/B/C, medians):
  specserve       continuous batching, paged KV cache (max_num_seqs = --batch-size)
  specserve-torch-ops  the same with SPECSERVE_CPU_KERNELS=0: decode attention (gather + matmuls),
                  RMSNorm, rope and argmax through torch ops instead of the C kernels, to show what the
                  kernels are worth
  hf-static       transformers generate() on static left-padded batches of --batch-size
  hf-sequential   transformers generate() one prompt at a time (on --sequential-prompts of them)
Each system's time is also split into prefill (steps that carry prompt tokens; for transformers, prompt to
first token) and the mean decode step. Also: the share of engine step time spent outside the model forward
while 32 requests decode, with the top cProfile entries outside the forward.

    python bench/engine_throughput.py [--repeats 3] [--threads 2] [--profile-only]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from importlib import resources

MODEL = "smollm2-135m"


def load_prompts(tokenizer, n: int, max_prompt_tokens: int) -> list[list[int]]:
    rows = json.loads((resources.files("specserve") / "data" / "sharegpt" / "ShareGPT_V3_filtered_1000.json").read_text())
    return [tokenizer.encode_chat([{"role": "user", "content": r["conversations"][0]["value"]}])[:max_prompt_tokens]
            for r in rows[:n]]


def run_specserve(args) -> dict:
    from specserve import LLM, SamplingParams
    llm = LLM(model=MODEL, dtype=args.dtype, max_num_seqs=args.batch_size, kv_cache_memory=args.kv_gib,
              num_threads=args.threads)
    prompts = load_prompts(llm.tokenizer, args.prompts, args.max_prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    engine, tokens = llm.engine, 0
    prefill_s, decode_s, decode_steps = 0.0, 0.0, 0
    t0 = time.perf_counter()
    for p in prompts:  # LLM.generate's loop, with each step's time booked to prefill or decode
        engine.add_request(p, params)
    while engine.has_unfinished():
        tokens += sum(len(o.token_ids) for o in engine.step() if o.finished)
        s = engine.last_stats
        if s.num_prefill_tokens:
            prefill_s += s.t_total
        else:
            decode_s, decode_steps = decode_s + s.t_total, decode_steps + 1
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "prefill_s": prefill_s,
            "decode_step_ms": decode_s / decode_steps * 1000}


def run_hf(args, sequential: bool) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from specserve.model.loader import load_model
    from specserve.model.registry import fetch
    torch.set_num_threads(args.threads)
    tok = load_model(MODEL, "float32").tokenizer
    model = LlamaForCausalLM.from_pretrained(str(fetch(MODEL)), dtype=getattr(torch, args.dtype)).eval()
    prompts = load_prompts(tok, args.sequential_prompts if sequential else args.prompts, args.max_prompt_tokens)
    size = 1 if sequential else args.batch_size
    tokens, prefill_s, decode_s, decode_steps = 0, 0.0, 0.0, 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), size):
        batch = prompts[i:i + size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_tokens, streamer=clock,
                                 min_new_tokens=args.output_tokens, do_sample=False, pad_token_id=0)
        tokens += (out.shape[1] - width) * len(batch)
        prefill_s += clock.times[1] - clock.times[0]  # the prompt's put, then the first new token's
        decode_s, decode_steps = decode_s + clock.times[-1] - clock.times[1], decode_steps + len(clock.times) - 2
    return {"tokens": tokens, "seconds": time.perf_counter() - t0, "prefill_s": prefill_s,
            "decode_step_ms": decode_s / decode_steps * 1000}


class StepClock:
    """A transformers streamer that only notes when generate() hands it the prompt and each new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_overhead(args) -> dict:
    """Step-time split while `batch` requests decode (prefill finished), plus what dominates outside."""
    import cProfile
    import pstats

    from specserve import LLM, SamplingParams
    llm = LLM(model=MODEL, dtype=args.dtype, max_num_seqs=32, kv_cache_memory=args.kv_gib, num_threads=args.threads)
    engine = llm.engine
    for p in load_prompts(llm.tokenizer, 32, args.max_prompt_tokens):
        engine.add_request(p, SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True))
    while engine.scheduler.waiting or any(s.in_prefill for s in engine.scheduler.running):
        engine.step()
    profile, totals, n = cProfile.Profile(), {}, 0
    profile.enable()
    for _ in range(30):
        engine.step()
        s = engine.last_stats
        for k in ("t_schedule", "t_draft", "t_forward", "t_sample", "t_other"):
            totals[k] = totals.get(k, 0.0) + getattr(s, k)
        n += 1
    profile.disable()
    stats = pstats.Stats(profile)
    outside = []
    for (file, line, fn), (_, _, tottime, _, _) in stats.stats.items():
        # engine-side Python (builtins are left out: most of them run inside the forward)
        if "specserve/" in file and "specserve/model/" not in file:
            outside.append((tottime / n * 1000, f"{os.path.basename(file)}:{fn}"))
    outside.sort(reverse=True)
    total = sum(totals.values())
    return {"split_ms": {k: v / n * 1000 for k, v in totals.items()},
            "outside_share": 1 - totals["t_forward"] / total, "top_outside": outside[:6],
            "op_shares": op_shares(engine)}


OP_KINDS = {"linear layers": ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm"),
            "decode attention (C kernel)": ("specserve::short_attention",),
            "RMSNorm (C kernel)": ("specserve::rms_norm",),
            "KV cache gather": ("aten::index_select",),
            "attention matmuls + softmax": ("aten::bmm", "aten::_softmax",
                                            "aten::_scaled_dot_product_flash_attention_for_cpu")}


def op_shares(engine, steps: int = 10) -> dict:
    """Share of the profiled steps' operator time per kind of work (torch.profiler, self CPU time)."""
    from torch.profiler import profile
    with profile() as prof:
        for _ in range(steps):
            engine.step()
    times = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(times.values())
    shares = {kind: sum(times.get(op, 0) for op in ops) / total for kind, ops in OP_KINDS.items()}
    shares["everything else"] = 1 - sum(shares.values())
    return shares


def child(args) -> None:
    result = {"specserve": run_specserve, "specserve-torch-ops": run_specserve,
              "hf-static": lambda a: run_hf(a, False),
              "hf-sequential": lambda a: run_hf(a, True), "overhead": run_overhead}[args.child](args)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print("RESULT " + json.dumps(result))


def spawn(system: str, argv: list[str]) -> dict:
    env = os.environ | ({"SPECSERVE_CPU_KERNELS": "0"} if system == "specserve-torch-ops" else {})
    out = subprocess.run([sys.executable, __file__, "--child", system] + argv, capture_output=True, text=True,
                         env=env)
    line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not line:
        raise SystemExit(f"{system} failed:\n{out.stderr[-2000:]}")
    return json.loads(line[-1][7:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--sequential-prompts", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile-only", action="store_true", help="only the step-time split at 32 decoding requests")
    p.add_argument("--child", default=None)
    args = p.parse_args()
    if args.child:
        return child(args)
    argv = [a for a in sys.argv[1:] if a != "--profile-only"]
    systems = [] if args.profile_only else ["specserve", "specserve-torch-ops", "hf-static", "hf-sequential"]
    runs = {s: [] for s in systems}
    for r in range(args.repeats):  # interleaved: a load spike hits all systems alike
        for s in systems:
            runs[s].append(spawn(s, argv))
            print(f"repeat {r + 1} {s}: {runs[s][-1]['tokens'] / runs[s][-1]['seconds']:.1f} tok/s", file=sys.stderr)
    overhead = spawn("overhead", argv)
    if systems:
        throughput_table(args, systems, runs)
    split = overhead["split_ms"]
    print(f"\nStep time at 32 decoding requests (ms): " + ", ".join(f"{k[2:]} {v:.2f}" for k, v in split.items()))
    print(f"outside the model forward: {overhead['outside_share'] * 100:.1f}% of step time; top entries:")
    for ms, name in overhead["top_outside"]:
        print(f"  {ms:.2f} ms/step  {name}")
    print("operator time by kind (torch.profiler, 10 steps): " +
          ", ".join(f"{kind} {share * 100:.0f}%" for kind, share in overhead["op_shares"].items()))


def throughput_table(args, systems: list[str], runs: dict) -> None:
    from specserve.model.registry import model_dir
    weights_gib = os.path.getsize(model_dir(MODEL) / "model.safetensors") / 2 / 2**30  # float32 file -> bf16
    tps = {s: statistics.median(r["tokens"] / r["seconds"] for r in runs[s]) for s in systems}
    print(f"\n{args.prompts} ShareGPT prompts (<= {args.max_prompt_tokens} tokens) x {args.output_tokens} output tokens, "
          f"{MODEL} {args.dtype}, batch {args.batch_size}, {args.threads} threads, median of {args.repeats}")
    print("| system | output tok/s | vs hf-static | peak RSS (GiB) | prefill (s) | decode step (ms) |\n"
          "|---|---|---|---|---|---|")
    for s in systems:
        rss = max(r["peak_rss_gib"] for r in runs[s])
        prefill, step = (statistics.median(r[k] for r in runs[s]) for k in ("prefill_s", "decode_step_ms"))
        print(f"| {s} | {tps[s]:.1f} | {tps[s] / tps['hf-static']:.2f}x | {rss:.2f} | {prefill:.1f} | {step:.1f} |")
    print("prefill: time in steps that carry prompt tokens (transformers: prompt to first token, padded batches); "
          "decode step: mean of the other steps")
    print(f"\nRSS goal for specserve: weights {weights_gib:.2f} + KV {args.kv_gib:.2f} + 1 GiB = "
          f"{weights_gib + args.kv_gib + 1:.2f} GiB")


if __name__ == "__main__":
    main()
