"""A mixture-of-experts decode step on the CPU against the time to read the weights it touches once.

A random-weight Qwen3-MoE shape (default: Qwen3-30B-A3B's 128 experts, 8 per token, 32 query / 4 KV heads of
128, with the hidden size, the experts' width and the layer count scaled down to fit this machine), its
matrices quantized (Q8_0 or Q4_0: experts on the int8 kernel path, one KernelLinear pair each). For each
batch of 1..32 decoding requests (--context tokens cached each) the engine's ModelRunner times a step and
counts, per layer, the experts its tokens touch; "read" is the time to read, once, the bytes the step must
read (the touched experts' blocks, the attention and LM-head matrices) at the memory bandwidth measured in
the same run (a sum over a buffer larger than the caches). The step grows with the experts touched, not
with the model's size: the ratio step / read is what a decode costs over its floor.

    python bench/moe_step_cost.py [--hidden 1024] [--moe-intermediate 384] [--layers 8] [--format q8_0]
        [--threads N] [--batches 1,2,4,8,16,32] [--context 256] [--reps 10]

Prints a table and writes bench/results/moe/<date>-<format>-<threads>t.json (--label names it otherwise). At
the default size the model takes ~1.3 GB (q8_0); the experts are quantized with gguf-py, a few minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "moe"


def build_model(args):
    """The random model, its experts quantized one layer at a time (the float experts of one layer at most in
    memory), every other matrix quantized by quantize_model."""
    from specserve.model.config import ModelConfig
    from specserve.model.cpu_linear import KernelLinear, quantize
    from specserve.model.llama import LlamaModel
    from specserve.model.mlp import set_experts
    from specserve.model.quantize import quantize_model
    config = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.moe_intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads,
                         head_dim=args.head_dim, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                         architecture="Qwen3MoeForCausalLM", num_experts=args.experts,
                         num_experts_per_tok=args.active, moe_intermediate_size=args.moe_intermediate,
                         norm_topk_prob=True)
    model = LlamaModel(config, device="meta")
    for layer in model.layers:
        layer.moe.gate_up = layer.moe.down = None  # never allocated in float: filled below, quantized
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    h, inter = config.hidden_size, config.moe_intermediate_size
    for layer in model.layers:
        pairs = []
        for _ in range(config.num_experts):
            gate_up = quantize(torch.randn(2 * inter, h, generator=gen) * 0.02, args.format)
            down = quantize(torch.randn(h, inter, generator=gen) * 0.02, args.format)
            pairs.append((KernelLinear.from_gguf_blocks(gate_up, args.format, h, interleave=True),
                          KernelLinear.from_gguf_blocks(down, args.format, inter)))
        set_experts(layer.moe, pairs)
    quantize_model(model, args.format)
    return model.eval().requires_grad_(False)


def matrix_bytes(module) -> int:
    from specserve.model.cpu_linear import KernelLinear, StackedKernelLinear
    if isinstance(module, (KernelLinear, StackedKernelLinear)):
        return module.weight_bytes
    return module.weight.numel() * module.weight.element_size()


def read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """Bytes per second of summing a buffer of `nbytes`, best of reps."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 8 / best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--moe-intermediate", type=int, default=384, help="each expert's width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--active", type=int, default=8, help="experts per token")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--format", default="q8_0", choices=["q8_0", "q4_0"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--context", type=int, default=256, help="tokens already cached per request")
    p.add_argument("--reps", type=int, default=10, help="timed steps per batch size")
    p.add_argument("--bandwidth-mb", type=int, default=1024,
                   help="the buffer that measures the read bandwidth (at least the active bytes): past the caches")
    p.add_argument("--label", default=None)
    p.add_argument("--results", type=Path, default=RESULTS, help="the folder the JSON goes to")
    p.add_argument("--note", default="", help="a line saved with the results (e.g. the machine's load)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from specserve.step_types import ForwardItem
    from specserve.engine.model_runner import ModelRunner
    from specserve.model.mlp import MoE

    model = build_model(args)
    batches = [int(b) for b in args.batches.split(",")]
    block = 16
    per_seq = -(-(args.context + 1) // block)
    runner = ModelRunner(model, max(batches) * per_seq, block)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_bytes = [sum(matrix_bytes(x) for x in pair) for pair in moes[0].experts]
    dense_bytes = sum(matrix_bytes(layer._modules[name]) for layer in model.layers for name in ("qkv_proj", "o_proj"))
    dense_bytes += sum(matrix_bytes(m.router) for m in moes) + matrix_bytes(model.lm_head)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(batches))]
    gen = torch.Generator().manual_seed(1)
    for table in tables:  # each request's cached context
        runner.forward([ForwardItem(torch.randint(0, args.vocab, (args.context,), generator=gen).tolist(),
                                    args.context, table, 1)])
    model_bytes = dense_bytes + sum(expert_bytes) * len(moes)
    bandwidth = read_bandwidth(max(args.bandwidth_mb << 20, model_bytes))
    rows = []
    for n in batches:
        items = [ForwardItem([int(t)], args.context + 1, tables[i], 1)
                 for i, t in enumerate(torch.randint(0, args.vocab, (n,), generator=gen))]
        touched = []  # experts each layer's tokens chose, counted in one untimed step of the same inputs
        hooks = [m.register_forward_pre_hook(lambda m, a: touched.append(m.route(a[0])[1].unique().numel()))
                 for m in moes]
        runner.forward(items)
        for hook in hooks:
            hook.remove()
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            runner.forward(items)
            times.append(time.perf_counter() - start)
        active = dense_bytes + sum(touched) * expert_bytes[0]
        step, read = statistics.median(times), active / bandwidth
        rows.append({"requests": n, "experts_touched_per_layer": sum(touched) / len(touched),
                     "active_mb": active / 1e6, "step_ms": step * 1e3, "read_ms": read * 1e3, "ratio": step / read})
    print(f"{args.layers} layers x {args.experts} experts ({args.active} active) of {args.hidden} x "
          f"{args.moe_intermediate}, {args.format}, {args.threads} threads, read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'requests':>8} {'experts/layer':>13} {'active MB':>9} {'step ms':>8} {'read ms':>8} {'step/read':>9}")
    for r in rows:
        print(f"{r['requests']:>8} {r['experts_touched_per_layer']:>13.1f} {r['active_mb']:>9.1f} {r['step_ms']:>8.2f} "
              f"{r['read_ms']:>8.2f} {r['ratio']:>9.2f}")
    result = {"args": vars(args) | {"results": str(args.results)}, "machine": platform.processor() or platform.machine(),
              "read_bandwidth_gb_s": bandwidth / 1e9, "rows": rows}
    label = args.label or f"{datetime.date.today()}-{args.format}-{args.threads}t"
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / f"{label}.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.results / label}.json")
    return result


if __name__ == "__main__":
    main()
