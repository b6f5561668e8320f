"""How close the linear kernel runs to this CPU's ceiling: multiply-adds per second of a bare instruction loop
against those of `kernels.linear` on SmolLM2-135M's matrices.

Part 1 compiles (cc -O2 -march=native) and runs a loop of 12 independent accumulators, one core:
`vpdpbusd` on ymm and zmm (AVX-512 VNNI: 32 / 64 int8 multiply-adds each; skipped without it). Part 2
times `kernels.linear` (weights hot in cache: an upper bound for a forward) on random Q4_1 matrices
(Q8_0 for the LM head), bf16 input, on both paths.

    python bench/cpu_peak.py [--threads 1] [--rows 1,8,32,128]

Prints only (numbers quoted in docs/cpu-kernels.md and docs/experiments/int8-dot-kernels.md name the machine).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

LOOP = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 100000000L
#define RUN(NAME, T, ZERO, OP, MACS)                                                              \
    {                                                                                             \
        T a[12], u = U, x = X;                                                                    \
        for (int i = 0; i < 12; i++) a[i] = ZERO;                                                 \
        double t = now();                                                                         \
        for (long k = 0; k < N; k++) { for (int i = 0; i < 12; i++) a[i] = OP; __asm__ volatile("" : "+v"(u)); } \
        t = now() - t;                                                                            \
        volatile T sink = a[0]; (void)sink;                                                       \
        printf("%-12s %6.1f G multiply-adds/s\n", NAME, N * 12.0 * MACS / t / 1e9);               \
    }
int main(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define U _mm256_set1_epi8(3)
#define X _mm256_set1_epi8(5)
    RUN("vpdpbusd ymm", __m256i, _mm256_setzero_si256(), _mm256_dpbusd_epi32(a[i], u, x), 32)
#undef U
#undef X
#define U _mm512_set1_epi8(3)
#define X _mm512_set1_epi8(5)
    RUN("vpdpbusd zmm", __m512i, _mm512_setzero_si512(), _mm512_dpbusd_epi32(a[i], u, x), 64)
#else
    printf("no AVX-512 VNNI on this CPU\n");
#endif
    return 0;
}
"""
SHAPES = {"qkv": (960, 576, "q4_1"), "gate_up": (3072, 576, "q4_1"), "down": (576, 1536, "q4_1"),
          "lm_head": (49152, 576, "q8_0")}


def instruction_peaks() -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(LOOP)
        subprocess.run([compiler, "-O2", "-march=native", "-o", str(exe), str(src)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")


def kernel_rates(rows_list: list[int]) -> None:
    from specserve.model import kernels
    from specserve.model.cpu_linear import KernelLinear, quantize
    for name, (n, k, fmt) in SHAPES.items():
        blocks = quantize(torch.randn(n, k) * 0.05, fmt)
        paths = {p: KernelLinear.from_gguf_blocks(blocks, fmt, k, int8_dot=p == "int8") for p in ("int8", "exact")}
        for rows in rows_list:
            x, cells = torch.randn(rows, k).bfloat16(), []
            for path, m in paths.items():
                call = lambda: kernels.linear(x, m.weight_data, m.fmt, m.in_features, m.padded)  # noqa: E731
                call()
                reps = max(3, int(1e8 // (n * k * rows)))
                times = []
                for _ in range(7):
                    t = time.perf_counter()
                    for _ in range(reps):
                        call()
                    times.append((time.perf_counter() - t) / reps)
                cells.append(f"{path} {n * k * rows / statistics.median(times) / 1e9:6.1f}")
            print(f"{name:8s} {fmt} {rows:4d} rows: " + " | ".join(cells) + " G multiply-adds/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,8,32,128")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    instruction_peaks()
    kernel_rates([int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    main()
