"""Issue 45 kernel benchmark: small-batch linear layers and whole-model forwards, ours against torch's.

Part 1, per shape (SmolLM2-135M's matrices: fused qkv 576->960, o 576->576, fused gate/up 576->3072,
down 1536->576, lm_head 576->49152) and rows (1, 2, 4, 9, 16): microseconds per call (median over
interleaved repeats) and the weight bytes read per second, for
  torch bf16          F.linear on a bf16 weight (what a bf16 model runs where oneDNN cannot pack bf16)
  torch onednn f32/bf16  oneDNN's pre-packed weight (PackedLinear, today's path where it packs)
  torch int8pack      torch.ops.aten._weight_int8pack_mm, bf16 input (per-channel int8 weights)
  torch int4pack      torch.ops.aten._weight_int4pack_mm_for_cpu, bf16 input (groups of 32)
  ours <fmt>          kernels/linear.c on bf16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights, bf16 input (GGUF
                      formats on integer dot products)
  exact <fmt>         the same on the exact path (blocks expanded to float32, SPECSERVE_INT8_DOT=0)
Every call reads weights that are not in the caches (each implementation cycles through enough copies
to exceed the last-level cache), as in a forward whose 30 layers do not fit in it.

Part 2, the whole target forward (ModelRunner, --context tokens cached per sequence) at 1, 2, 4, 9 and
16 rows of one sequence (a decode, verifies of k = 1, 3, 8, 15), 4, 16 and 32 one-row sequences (decode
batches) and one 256-token prefill chunk, for
  before bf16         the path before issue 45: oneDNN-packed or F.linear bf16 matrices, SDPA prefill
  ours bf16           KernelLinear bf16, batch invariant (attention kernel for every query)
  ours q8_0 / q4_0    matrices quantized at load (--quantization q8_0 / q4_0)
  ours gguf           the default model's own GGUF blocks (Q4_1 layers, Q8_0 head)
in ms (median over interleaved repeats, with the 25th-75th percentile spread), and each row count's
time over the 1-row forward of the same variant.

    python bench/cpu_kernels.py [--threads 2] [--repeats 7] [--part shapes|model|both] [--label NAME]
                                [--impls "ours bf16,ours q6_k"] [--shapes lm_head,down]

Writes bench/results/cpu-kernels/<label>.md and .json (label default: the date and the thread count).
A before/after comparison: interleave runs labelled <folder>/before-r1, <folder>/after-r1, ... (the "before"
side on another checkout's package through PYTHONPATH), then `--compare bench/results/cpu-kernels/<folder>`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.benchmark.machine import cpu_flags, cpu_model
from specserve.settings import settings

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
ROWS = [1, 2, 4, 5, 8, 9, 16, 32, 64]
LLC_BYTES = 64 << 20  # at least this many bytes of weights cycled per implementation (> the L3 here)
FORWARD_SHAPES = [(1, 1), (1, 2), (1, 4), (1, 5), (1, 9), (1, 16), (2, 1), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1),
                  (1, 256)]  # (seqs, rows)
RESULTS = Path(__file__).parent / "results" / "cpu-kernels"


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


# ---------------------------------------------------------------- part 1: one matrix

def shape_impls(n: int, k: int) -> dict:
    """name -> (list of weight copies, function(weight, x), weight bytes)."""
    from specserve.model import kernels
    from specserve.model.cpu_linear import KernelLinear, quantize
    from specserve.model.packed_linear import PackedLinear
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    impls = {}

    def add(name, make, fn):
        one = make()
        nbytes = one.numel() * one.element_size() if isinstance(one, torch.Tensor) else one[0]
        copies = max(2, -(-LLC_BYTES // nbytes))
        impls[name] = ([one] + [make() for _ in range(copies - 1)], fn, nbytes)

    add("torch bf16", lambda: w.bfloat16(), lambda wt, x: F.linear(x, wt))
    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        try:
            PackedLinear(nn.Linear(8, 8).to(dtype))
        except RuntimeError:
            continue
        lin = nn.Linear(k, n, bias=False).to(dtype)
        lin.weight.data.copy_(w)

        def make(lin=lin):
            p = PackedLinear(lin)
            p.nbytes = n * k * lin.weight.element_size()
            return p
        add_module(impls, f"torch onednn {tag}", make, lambda m, x, dtype=dtype: m(x.to(dtype)), n * k * (4 if tag == "f32" else 2))
    scales = torch.rand(n).bfloat16()
    add("torch int8pack", lambda: torch.randint(-127, 127, (n, k), dtype=torch.int8),
        lambda wt, x: torch.ops.aten._weight_int8pack_mm(x, wt, scales))
    try:
        int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.rand(k // 32, n, 2).bfloat16()
        add_module(impls, "torch int4pack", lambda: int4.clone(),
                   lambda wt, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, wt, 32, sz), n * k // 2 + n * k // 32 * 4)
    except (RuntimeError, AttributeError):
        pass
    for name in ("ours bf16", "ours q8_0", "ours q4_0", "ours q4_1", "ours q4_k", "ours q6_k", "exact q8_0",
                 "exact q4_1", "exact q6_k"):
        fmt = name.split()[1]
        if fmt in ("q4_k", "q6_k") and k % 256:
            continue
        if fmt == "bf16":
            lin = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            lin.weight.data.copy_(w)
            make = lambda lin=lin: KernelLinear.from_linear(lin)  # noqa: E731
        else:
            blocks = random_super_blocks(n, k, fmt) if fmt in ("q4_k", "q6_k") else quantize(w, fmt)
            make = lambda blocks=blocks, fmt=fmt, dot=name.startswith("ours"): KernelLinear.from_gguf_blocks(  # noqa: E731
                blocks, fmt, k, int8_dot=dot)
        add_module(impls, name, make, lambda m, x: kernels.linear(
            x, m.weight_data, m.fmt, m.in_features, m.padded), make().weight_bytes)
    return impls


def add_module(impls: dict, name: str, make, fn, nbytes: int) -> None:
    copies = max(2, -(-LLC_BYTES // nbytes))
    impls[name] = ([make() for _ in range(copies)], fn, nbytes)


def random_super_blocks(n: int, k: int, fmt: str) -> torch.Tensor:
    """Q4_K or Q6_K blocks of random bytes under small positive f16 super-scales (gguf-py quantizes to
    neither; the kernel's speed does not depend on the values)."""
    import numpy as np
    nbytes, first = {"q4_k": (144, 0), "q6_k": (210, 208)}[fmt]  # where the f16 scales (d, Q4_K's dmin) sit
    scales = 4 if fmt == "q4_k" else 2
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, size=(n, k // 256, nbytes), dtype=np.uint8)
    b[..., first:first + scales] = np.frombuffer(
        rng.uniform(1e-3, 0.05, n * (k // 256) * scales // 2).astype(np.float16).tobytes(), np.uint8
    ).reshape(n, k // 256, scales)
    return torch.from_numpy(b.reshape(n, -1))


def bench_shapes(args) -> list[dict]:
    out = []
    for shape, (n, k) in SHAPES.items():
        if args.shapes and shape not in args.shapes.split(","):
            continue
        impls = shape_impls(n, k)
        if args.impls:
            impls = {name: impl for name, impl in impls.items() if name in args.impls.split(",")}
        for rows in ROWS:
            x = torch.randn(rows, k).bfloat16()
            times = {name: [] for name in impls}
            cpu = {name: [] for name in impls}
            counters = {name: 0 for name in impls}
            calls = max(3, min(50, int(2e8 // (n * k * 2))))  # ~0.1 s of bf16 weights per repeat and impl
            for name, (ws, fn, _) in impls.items():  # warm-up: oneDNN picks its kernels per shape
                fn(ws[0], x)
            for _ in range(args.repeats):
                for name, (ws, fn, _) in impls.items():
                    samples = []
                    for _ in range(calls):
                        wt = ws[counters[name] % len(ws)]
                        counters[name] += 1
                        t, c = time.perf_counter(), time.thread_time()
                        fn(wt, x)
                        samples.append(time.perf_counter() - t)
                        cpu[name].append(time.thread_time() - c)
                    times[name].append(statistics.median(samples))
            for name, (_, _, nbytes) in impls.items():
                p25, med, p75 = quantiles(times[name])
                out.append({"shape": shape, "n": n, "k": k, "rows": rows, "impl": name, "us": med * 1e6,
                            "us_p25": p25 * 1e6, "us_p75": p75 * 1e6, "gbps": nbytes / med / 1e9,
                            "cpu_us_min": min(cpu[name]) * 1e6, "weight_bytes": nbytes})
            best = min((r for r in out if r["shape"] == shape and r["rows"] == rows), key=lambda r: r["us"])
            print(f"{shape:8s} rows {rows:2d}: fastest {best['impl']} {best['us']:.0f} us", flush=True)
    return out


def shapes_table(rows: list[dict], key: str = "us") -> str:
    """key "us": median wall and the GB/s of weights it makes; "cpu_us_min": the least CPU time of the
    thread (one thread only) and its GB/s."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = ["| shape | rows | " + " | ".join(impls) + " |", "|---|---|" + "---|" * len(impls)]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for n in ROWS:
            cells = []
            for impl in impls:
                r = next((r for r in rows if r["shape"] == shape and r["rows"] == n and r["impl"] == impl), None)
                cells.append("" if r is None else f"{r[key]:.0f} us, {r['weight_bytes'] / r[key] / 1e3:.1f} GB/s")
            lines.append(f"| {shape} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- part 2: the whole forward

class TorchLinear(nn.Module):
    """F.linear, wrapped so that pack_linears leaves it alone (the 'before' variant's bf16 fallback)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


def before_issue_45(model: nn.Module) -> None:
    """The linear layers as they were: oneDNN-packed where it packs, else F.linear."""
    from specserve.model.packed_linear import PackedLinear, can_pack
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                try:
                    new = PackedLinear(child) if can_pack(child.weight) else TorchLinear(child)
                except RuntimeError:
                    new = TorchLinear(child)
                setattr(parent, name, new)


def load_variants(args) -> dict:
    from specserve.model.loader import load_model
    from specserve.model.quantize import weight_summary
    variants, default_int8_dot = {}, settings.int8_dot
    for name in args.variants.split(","):
        quant = {"ours q8_0": "q8_0", "ours q4_0": "q4_0", "ours gguf": "gguf", "exact gguf": "gguf"}.get(name)
        settings.int8_dot = not name.startswith("exact")
        loaded = load_model(args.model, "bfloat16", "cpu", quantization=quant)
        settings.int8_dot = default_int8_dot
        summary = weight_summary(loaded.model)  # before packing: counts nn.Linear and KernelLinear
        if name == "before bf16":
            before_issue_45(loaded.model)
        variants[name] = (loaded.model, summary)
    return variants


def bench_model(args) -> list[dict]:
    from specserve.engine.model_runner import ForwardItem, ModelRunner
    block = 16
    max_seqs = max(s for s, _ in FORWARD_SHAPES)
    per_seq = -(-(args.context + max(r for _, r in FORWARD_SHAPES)) // block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max_seqs)]
    prompt = list(range(100, 100 + args.context))
    runners, summaries, default_batch_invariant = {}, {}, settings.batch_invariant
    for name, (model, summary) in load_variants(args).items():
        runners[name] = ModelRunner(model, max_seqs * per_seq, block)
        summaries[name] = summary
        print(f"{name}: {summaries[name]}", flush=True)

    def forward(name: str, seqs: int, rows: int) -> tuple[float, float]:
        """(wall, CPU time of this thread) of one forward. Every row of a verify asks for logits; the
        cached context stays as it is."""
        settings.batch_invariant = name != "before bf16"
        items = [ForwardItem([5] * rows, args.context + rows, tables[i], rows if rows <= 16 else 1)
                 for i in range(seqs)]
        wall, cpu = time.perf_counter(), time.thread_time()
        runners[name].forward(items)
        return time.perf_counter() - wall, time.thread_time() - cpu

    for name in runners:  # fill every sequence's cache once, then warm up each shape
        for table in tables:
            settings.batch_invariant = name != "before bf16"
            runners[name].forward([ForwardItem(prompt, args.context, table, 1)])
        for shape in FORWARD_SHAPES:
            forward(name, *shape)
    times = {(n, s): [] for n in runners for s in FORWARD_SHAPES}
    cpu = {(n, s): [] for n in runners for s in FORWARD_SHAPES}
    for rep in range(args.repeats):
        for shape in FORWARD_SHAPES:
            reps = 1 if shape[1] > 16 else args.reps
            for name in runners:
                samples = [forward(name, *shape) for _ in range(reps)]
                times[name, shape].append(statistics.median(w for w, _ in samples))
                cpu[name, shape] += [c for _, c in samples]
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    settings.batch_invariant = default_batch_invariant
    out = []
    for (name, (seqs, rows)), ts in times.items():
        p25, med, p75 = quantiles(ts)
        out.append({"variant": name, "seqs": seqs, "rows_per_seq": rows, "rows": seqs * rows, "ms": med * 1e3,
                    "ms_p25": p25 * 1e3, "ms_p75": p75 * 1e3, "cpu_ms_min": min(cpu[name, (seqs, rows)]) * 1e3,
                    "weights": summaries[name]})
    return out


def model_table(rows: list[dict], key: str = "ms") -> str:
    """key "ms": median wall (p25-p75); "cpu_ms_min": the least CPU time of the calling thread, which a
    busy machine inflates least (meaningful with one thread: other threads' time is not counted)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    lines = ["| sequences x rows | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for seqs, n in FORWARD_SHAPES:
        cells = []
        for v in variants:
            r = next(r for r in rows if r["variant"] == v and r["seqs"] == seqs and r["rows_per_seq"] == n)
            one = next(r for r in rows if r["variant"] == v and r["seqs"] == 1 and r["rows_per_seq"] == 1)
            spread = f" ({r['ms_p25']:.1f}-{r['ms_p75']:.1f})" if key == "ms" else ""
            cells.append(f"{r[key]:.1f}{spread}, {r[key] / one[key]:.2f}x")
        lines.append(f"| {seqs} x {n} | " + " | ".join(cells) + " |")
    lines += ["", "Weights: " + "; ".join(f"{v}: {next(r['weights'] for r in rows if r['variant'] == v)}"
                                         for v in variants)]
    return "\n".join(lines)


def compare(folder: Path) -> str:
    """The before/after table of interleaved part-2 runs saved as <folder>/before-r<i> and after-r<i>
    (--label <folder>/before-r1 ...): each shape's runs, the speedup of the medians, and each side's
    time over its own 1-row forward. Written to <folder>/summary.md."""
    runs = {}
    for f in sorted(folder.glob("*-r*.json")):
        data = json.loads(f.read_text())
        side = f.stem.split("-r")[0]
        runs.setdefault(side, []).append({(r["seqs"], r["rows_per_seq"]): r["ms"] for r in data["model"]})
        runs.setdefault(side + " note", data["args"].get("note", ""))
    lines = [f"# {folder.name}: before / after\n", f"`python bench/cpu_kernels.py --compare {folder}` over the runs "
             f"in this folder (each file's header names its command), {cpu_model()}.\n",
             *(f"- {side}, {len(runs[side])} runs: {runs[side + ' note'].removeprefix(side + ': ')}"
               for side in ("before", "after")), "",
             "Whole-forward ms, each run's median; speedup of the medians; each side's time over its 1-row forward.\n",
             "| sequences x rows | before runs | after runs | speedup | before / 1 row | after / 1 row |",
             "|---|---|---|---|---|---|"]
    med = {side: {shape: statistics.median(run[shape] for run in runs[side]) for shape in FORWARD_SHAPES}
           for side in ("before", "after")}
    for shape in FORWARD_SHAPES:
        cells = [" ".join(f"{run[shape]:.1f}" for run in runs[side]) for side in ("before", "after")]
        before, after = med["before"], med["after"]
        lines.append(f"| {shape[0]} x {shape[1]} | {cells[0]} | {cells[1]} | {before[shape] / after[shape]:.2f}x | "
                     f"{before[shape] / before[1, 1]:.2f}x | {after[shape] / after[1, 1]:.2f}x |")
    text = "\n".join(lines) + "\n"
    (folder / "summary.md").write_text(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--reps", type=int, default=5, help="forwards per shape, variant and repeat (median taken)")
    p.add_argument("--part", choices=["shapes", "model", "both"], default="both")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=256, help="tokens already cached per sequence")
    p.add_argument("--variants", default="before bf16,ours bf16,ours q8_0,ours q4_0,ours gguf")
    p.add_argument("--impls", default="", help="part 1: only these implementations (comma-separated names)")
    p.add_argument("--shapes", default="", help="part 1: only these shapes (" + ",".join(SHAPES) + ")")
    p.add_argument("--label", default=None)
    p.add_argument("--note", default="", help="a line saved with the results (e.g. 'machine shared with 2 others')")
    p.add_argument("--compare", type=Path, default=None,
                   help="only print (and save as summary.md) the before/after table of the runs in this folder")
    args = p.parse_args()
    if args.compare:
        print(compare(args.compare))
        return
    torch.set_num_threads(args.threads)
    label = args.label or f"{datetime.date.today()}-{args.threads}t"
    cpu = cpu_model()
    flags = cpu_flags()
    header = (f"# CPU kernels ({label})\n\n`python bench/cpu_kernels.py {' '.join(os.sys.argv[1:])}`: {cpu}, "
              f"{os.cpu_count()} CPUs, {args.threads} threads, torch {torch.__version__}, AVX512-BF16 "
              f"{'yes' if 'avx512_bf16' in flags else 'no'}, AVX2 {'yes' if 'avx2' in flags else 'no'}. "
              f"{args.note}\n")
    result = {"label": label, "args": vars(args), "cpu": cpu}
    md = [header]
    if args.part in ("shapes", "both"):
        result["shapes"] = bench_shapes(args)
        md += ["## One matrix: median wall us per call, weight GB/s (weights not in cache)\n",
               shapes_table(result["shapes"]), ""]
        print(shapes_table(result["shapes"]), flush=True)
        if args.threads == 1:
            md += ["## The same, least CPU time of the thread per call\n", shapes_table(result["shapes"], "cpu_us_min"), ""]
            print(shapes_table(result["shapes"], "cpu_us_min"), flush=True)
    if args.part in ("model", "both"):
        result["model"] = bench_model(args)
        md += [f"## Whole forward, {args.context} cached tokens per sequence: median wall ms (p25-p75), "
               "time over the 1-row forward\n", model_table(result["model"]), ""]
        print(model_table(result["model"]), flush=True)
        if args.threads == 1:
            md += ["## The same, least CPU time of the thread (ms), over the 1-row forward\n",
                   model_table(result["model"], "cpu_ms_min"), ""]
            print(model_table(result["model"], "cpu_ms_min"), flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{label}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{label}.md").write_text("\n".join(md))
    print(f"wrote {RESULTS / label}.md and .json")


if __name__ == "__main__":
    main()
