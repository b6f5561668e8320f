"""Cost of one target forward by the rows it carries: what a verify step costs under load (issue 8).

A decode step feeds each running request 1 row; a speculative step at k feeds it k + 1. Each shape below
(sequences x rows per sequence) runs the target forward of the engine's ModelRunner over a paged cache
already holding --context tokens per sequence; shapes are interleaved, each timed --reps times per
repeat, and the table gives the median over repeats of each repeat's median, in ms.
`--compare-unpadded` also times every shape with the linears' small-input padding off
(`PackedLinear.min_rows = 1`), interleaved with the padded runs, and adds that column.

    python bench/forward_cost.py [--threads 1] [--context 352] [--repeats 5] [--compare-unpadded]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.engine.model_runner import ForwardItem, ModelRunner
from specserve.model.loader import load_model
from specserve.model.packed_linear import MIN_ROWS, PackedLinear

SHAPES = [(1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 10), (1, 20), (2, 1), (4, 1), (6, 1), (8, 1), (12, 1), (16, 1),
          (2, 5), (4, 5)]  # (sequences, rows each)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=352, help="tokens already cached per sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--reps", type=int, default=10, help="timed forwards per shape and repeat")
    p.add_argument("--compare-unpadded", action="store_true",
                   help="also time each shape without padding small inputs of the linears")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model(args.model, "bfloat16", "cpu")
    block = 16
    max_seqs = max(s for s, _ in SHAPES)
    per_seq = -(-(args.context + max(r for _, r in SHAPES)) // block)
    runner = ModelRunner(target.model, max_seqs * per_seq, block)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max_seqs)]
    prompt = list(range(100, 100 + args.context))
    for table in tables:
        runner.forward([ForwardItem(prompt, args.context, table, 1)])

    def forward(seqs: int, rows: int) -> float:
        # Every row asks for logits, as a verify does; the cached context stays as it is.
        items = [ForwardItem([5] * rows, args.context + rows, tables[i], rows) for i in range(seqs)]
        start = time.perf_counter()
        runner.forward(items)
        return time.perf_counter() - start

    modes = {"ms": MIN_ROWS} | ({"ms, unpadded": 1} if args.compare_unpadded else {})
    for min_rows in modes.values():  # warm-up: oneDNN picks and caches its kernels per shape
        PackedLinear.min_rows = min_rows
        for shape in SHAPES:
            forward(*shape)
    medians: dict[tuple[str, tuple[int, int]], list[float]] = {(m, shape): [] for m in modes for shape in SHAPES}
    for _ in range(args.repeats):
        for shape in SHAPES:
            for mode, min_rows in modes.items():
                PackedLinear.min_rows = min_rows
                medians[mode, shape].append(statistics.median(forward(*shape) for _ in range(args.reps)))
    PackedLinear.min_rows = MIN_ROWS
    ms = {key: statistics.median(values) * 1000 for key, values in medians.items()}
    base = ms["ms", (1, 1)]
    print(f"target forward, {args.threads} thread(s), {args.context} cached tokens per sequence, "
          f"median of {args.repeats} repeats:\n")
    print("| sequences x rows | rows | " + " | ".join(modes) + " | vs 1 x 1 |")
    print("|---|---|" + "---|" * len(modes) + "---|")
    for seqs, rows in SHAPES:
        cells = " | ".join(f"{ms[mode, (seqs, rows)]:.1f}" for mode in modes)
        print(f"| {seqs} x {rows} | {seqs * rows} | {cells} | {ms['ms', (seqs, rows)] / base:.2f}x |")


if __name__ == "__main__":
    main()
