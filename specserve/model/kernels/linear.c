/* Linear layers y = x W^T (+ bias) on the CPU, for weights in float32, bf16 or GGUF blocks (Q8_0,
 * Q4_0, Q4_1, Q4_K, Q6_K), read straight from their blocks: no dequantized copy of the weights exists.
 *
 * Why not torch: on CPUs without AVX-512, torch's bf16 F.linear (oneDNN cannot pack bf16 weights there)
 * reads a decode's weights at 4-15 GB/s and its int8/int4 weight-only kernels at 1-13 GB/s, and none
 * reads GGUF blocks (bench/cpu_kernels.py has the numbers).
 *
 * Batch invariance by construction: every output element is one dot product computed the same way
 * whatever the number of rows, the tiling or the threads: 16 lanes of float32 partial sums over the
 * input in steps of 16 (lane l takes elements l, l + 16, l + 32, ...; one fused multiply-add each with
 * AVX2, a multiply and an add in the portable build), then the lanes summed in one fixed tree. The
 * weights are first expanded to float32 exactly (every format's value d*q + m fits a float32, as
 * gguf-py's dequantize computes it), so the result differs from the dequantized float32 matrix times x
 * only in the order of accumulation. This file is compiled without -ffast-math (see kernels/__init__.py)
 * so that the compiler keeps that order.
 *
 * Shapes (row-major, element strides): x [rows, K] with row stride x_stride, unit stride along K;
 * w: N rows of w_row_bytes bytes each (float32/bf16 rows padded with zeros to Kp, a multiple of 16;
 * GGUF rows are K / block_size blocks, K a multiple of the block size, Kp == K); bias [N] float32 or NULL;
 * out [rows, N] with row stride out_stride (with mode SWIGLU: [rows, N / 2]). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_block.h"
#include "int8_dot.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SIMD 1
#else
#define SIMD 0
#endif

/* FMT_I4, FMT_I8, FMT_I4_WIDE, FMT_I6: 4-bit, 8-bit and Q6_K's 6-bit weights in int8_dot.h's layouts (f16
 * scales; float32 for Q4_K's), multiplied by int8-quantized activations; fmt - FMT_I4 is int8_dot.h's kind. */
enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_Q8_0 = 2, FMT_Q4_0 = 3, FMT_Q4_1 = 4, FMT_Q4_K = 5, FMT_Q6_K = 6, FMT_I4 = 7,
       FMT_I8 = 8, FMT_I4_WIDE = 9, FMT_I6 = 10 };
/* What happens to each result y (after the bias): STORE writes it; ADD adds it, rounded to the output
 * dtype, to what out holds (the residual stream, as `x + linear(h)` in torch); SWIGLU takes outputs in
 * pairs (2i: gate_i, 2i + 1: up_i) and writes silu(gate_i) * up_i at column i, rounding as torch's
 * `F.silu(gate) * up` on the rounded projections does. */
enum { MODE_STORE = 0, MODE_ADD = 1, MODE_SWIGLU = 2 };

#define STEP 16     /* input elements per step of a dot product: 16 float32 partial sums */
#define GROUP 4     /* output rows expanded to float32 at once (scratch of GROUP * Kp floats per thread) */
#define SPAN 32     /* outputs a work item of the integer path takes at most (one epilogue call for them all) */
#define ROW_BLOCK 48 /* input rows converted to float32 at once (kept in L2 while every group reads them) */
#define MAX_RT 3    /* rows per register tile: 3 rows x 2 outputs x 2 vectors = 12 accumulators */
/* Up to this many rows expand the weights in registers (row_tile, in chunks of up to 4 rows), more to
 * scratch. 3-4 rows ran 1.3-1.45x faster in registers than through scratch, 5-8 rows 1.0-1.2x, 9 and 16
 * the same within noise (Q4_1 and Q8_0 gate/up and down matrices, 2 threads, interleaved builds). */
#define IN_REGISTERS 8

/* ---- one block of 32 weights of a row, expanded to float32 exactly ----
 * block32(fmt, row, b, f) sets f to weights 32 b .. 32 b + 31 of the row: four vectors of 8 with AVX2,
 * 32 floats in the portable build. Float32 and bf16 rows are padded to a multiple of 32 (Kp). */

#if SIMD
typedef __m256 vec;
#define VECS 4 /* vectors per block */

#else
typedef float vec;
#define VECS 32 /* floats per block */
#endif

/* 32 nibbles (16 bytes) as floats. Layout chosen at load (`repack_q4` in cpu_linear.py): byte l < 8
 * holds weight l in its low nibble and weight 8 + l in its high one, byte 8 + l weights 16 + l and
 * 24 + l, so that two zero-extensions of 8 bytes give all four vectors. */
static inline void nibbles(const uint8_t *q, vec *f) {
#if SIMD
    const __m256i nib = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8)));
    f[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, nib));
    f[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    f[2] = _mm256_cvtepi32_ps(_mm256_and_si256(b, nib));
    f[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    for (int l = 0; l < 8; l++) {
        f[l] = (float)(q[l] & 0x0f);
        f[8 + l] = (float)(q[l] >> 4);
        f[16 + l] = (float)(q[8 + l] & 0x0f);
        f[24 + l] = (float)(q[8 + l] >> 4);
    }
#endif
}

/* f = q * scale + offset, exact (see block32). */
static inline void scale_offset(vec *f, float scale, float offset) {
#if SIMD
    const vec sv = _mm256_set1_ps(scale), ov = _mm256_set1_ps(offset);
    for (int i = 0; i < 4; i++) f[i] = _mm256_fmadd_ps(f[i], sv, ov);
#else
    for (int i = 0; i < 32; i++) f[i] = f[i] * scale + offset;
#endif
}

/* Formats (gguf-py's dequantize computes the same values):
 *   Q8_0 block of 32: f16 d, int8 q[32]; w = d q.
 *   Q4_0 block of 32: f16 d, 16 bytes of nibbles; w = d (q - 8).   Q4_1: f16 d, f16 m, 16 bytes; w = d q + m.
 *   Q4_K super-block of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins of 8 sub-blocks of 32,
 *        8 x 16 bytes of nibbles; w = (d sc) q - (dmin m).
 *   Q6_K super-block of 256: 6-bit q in two planes, an int8 scale per 16 weights, f16 d (gguf_block.h's
 *        q6_k_block); w = (d sc) (q - 32), exact in float32 (11 + 7 + 5 significant bits).
 * The nibbles are in the order `nibbles` reads. d q, 8 d, d sc, dmin m and (d sc) q are exact in
 * float32, so one fused multiply-add rounds d q + m (and d q - 8 d) as the separate operations do.
 * ks: for Q4_K, the current super-block's `q4_k_scales` (the caller computes them once per 8 blocks). */
static inline __attribute__((always_inline)) void block32(const int fmt, const uint8_t *row, int b, vec *f,
                                                          const float *ks) {
    if (fmt == FMT_F32) {
        const float *w = (const float *)row + 32 * b;
#if SIMD
        for (int i = 0; i < 4; i++) f[i] = _mm256_loadu_ps(w + 8 * i);
#else
        for (int i = 0; i < 32; i++) f[i] = w[i];
#endif
    } else if (fmt == FMT_BF16) {
        const uint16_t *w = (const uint16_t *)row + 32 * b;
#if SIMD
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 8 * i))), 16));
#else
        for (int i = 0; i < 32; i++) f[i] = bf16_to_f32(w[i]);
#endif
    } else if (fmt == FMT_Q8_0) {
        const uint8_t *p = row + 34 * b;
        const float d = f16_to_f32(read_u16(p));
        const int8_t *q = (const int8_t *)(p + 2);
#if SIMD
        const vec dv = _mm256_set1_ps(d);
        for (int i = 0; i < 4; i++)
            f[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * i)))), dv);
#else
        for (int i = 0; i < 32; i++) f[i] = (float)q[i] * d;
#endif
    } else if (fmt == FMT_Q4_0) {
        const uint8_t *p = row + 18 * b;
        const float d = f16_to_f32(read_u16(p));
        nibbles(p + 2, f);
        scale_offset(f, d, -8.f * d);
    } else if (fmt == FMT_Q4_1) {
        const uint8_t *p = row + 20 * b;
        nibbles(p + 4, f);
        scale_offset(f, f16_to_f32(read_u16(p)), f16_to_f32(read_u16(p + 2)));
    } else if (fmt == FMT_Q4_K) {
        const int j = b % 8;
        nibbles(row + 144 * (b / 8) + 16 + 16 * j, f);
        scale_offset(f, ks[j], ks[8 + j]);
    } else { /* FMT_Q6_K: weights 0-15 take scale 2 j, 16-31 scale 2 j + 1 */
        const uint8_t *p = row + 210 * (b / 8);
        const int j = b % 8;
        const float d = f16_to_f32(read_u16(p + 208));
        const float s0 = d * (float)(int8_t)p[192 + 2 * j], s1 = d * (float)(int8_t)p[193 + 2 * j];
#if SIMD
        const int n = j / 4, k = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32 * (k % 2)));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
        if (k >= 2) ql = _mm256_srli_epi16(ql, 4);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
        const __m256i q = _mm256_or_si256(_mm256_and_si256(ql, _mm256_set1_epi8(0x0f)), _mm256_slli_epi16(hi, 4));
        const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q0));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q0, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q1));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q1, 8)));
        for (int i = 0; i < 4; i++) { /* q s - 32 s: the exact (q - 32) s, rounded once */
            const __m256 sv = _mm256_set1_ps(i < 2 ? s0 : s1);
            f[i] = _mm256_fmadd_ps(f[i], sv, _mm256_mul_ps(sv, _mm256_set1_ps(-32.f)));
        }
#else
        uint8_t q[32];
        q6_k_block(p, j, q);
        for (int i = 0; i < 32; i++) {
            const float s = i < 16 ? s0 : s1;
            f[i] = (float)q[i] * s + -32.f * s;
        }
#endif
    }
}

/* Bytes of one block of 32 weights in a row of this format (Q4_K, Q6_K: a super-block is 8 of them; Q6_K's
 * 26.25 rounded down, close enough for prefetching). */
static inline int block_bytes(const int fmt) {
    return fmt == FMT_F32 ? 128 : fmt == FMT_BF16 ? 64 : fmt == FMT_Q8_0 ? 34 : fmt == FMT_Q4_1 ? 20
         : fmt == FMT_Q6_K ? 26 : 18;
}

/* Asks for block b of the row at `ahead` (a row the caller reads next), so that it arrives from memory
 * while this one is computed. Why: a matrix larger than the caches (every layer of a decode, the LM head)
 * streamed this way read at 3-5 GB/s per core on the EPYC here, the hardware prefetcher not keeping up
 * with several rows read side by side; asked for one group of rows ahead, the LM head's 30 MB of Q8_0
 * read in half the time (bench/cpu_kernels.py). A prefetch never faults, so reading past the last row is
 * harmless. */
static inline __attribute__((always_inline)) void prefetch_block(const int fmt, const uint8_t *ahead, int b) {
#if SIMD
    const char *p = (const char *)ahead + (int64_t)b * block_bytes(fmt);
    _mm_prefetch(p, _MM_HINT_T0);
    if (fmt == FMT_F32) _mm_prefetch(p + 64, _MM_HINT_T0);
#else
    (void)fmt, (void)ahead, (void)b;
#endif
}

static inline __attribute__((always_inline)) void expand_fmt(const int fmt, const uint8_t *row, int K, float *dst,
                                                          const uint8_t *ahead) {
    vec f[VECS];
    float ks[16];
    for (int b = 0; b < K / 32; b++) {
        if (ahead != NULL) prefetch_block(fmt, ahead, b);
        if (fmt == FMT_Q4_K && b % 8 == 0) q4_k_scales(row + 144 * (b / 8), ks);
        block32(fmt, row, b, f, ks);
#if SIMD
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 32 * b + 8 * i, f[i]);
#else
        memcpy(dst + 32 * b, f, sizeof f);
#endif
    }
}

/* One weight row (K a multiple of 32) as float32; `ahead` (or NULL): a row to prefetch meanwhile. */
static void expand_row(int fmt, const uint8_t *row, int K, float *dst, const uint8_t *ahead) {
    switch (fmt) {
    case FMT_F32: expand_fmt(FMT_F32, row, K, dst, ahead); break;
    case FMT_BF16: expand_fmt(FMT_BF16, row, K, dst, ahead); break;
    case FMT_Q8_0: expand_fmt(FMT_Q8_0, row, K, dst, ahead); break;
    case FMT_Q4_0: expand_fmt(FMT_Q4_0, row, K, dst, ahead); break;
    case FMT_Q4_1: expand_fmt(FMT_Q4_1, row, K, dst, ahead); break;
    case FMT_Q4_K: expand_fmt(FMT_Q4_K, row, K, dst, ahead); break;
    case FMT_Q6_K: expand_fmt(FMT_Q6_K, row, K, dst, ahead); break;
    default: int8_dequantize_row(fmt - FMT_I4, row, K, dst); break; /* FMT_I4 .. FMT_I6 */
    }
}

/* ---- dot products of a tile of RT input rows x OT weight rows (float32, Kp a multiple of STEP) ---- */

#if SIMD
static inline float lane_sum(__m256 a0, __m256 a1) { /* the fixed tree: 8 + 8, 4 + 4, 2 + 2, 1 + 1 */
    const __m256 s = _mm256_add_ps(a0, a1);
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

static inline __attribute__((always_inline)) void tile(const float *w, int64_t ws, const float *x, int64_t xs,
                                                       int Kp, const int RT, const int OT, float *y) {
    __m256 acc[MAX_RT][4][2];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o][0] = acc[r][o][1] = _mm256_setzero_ps();
    for (int k = 0; k < Kp; k += STEP) {
        for (int h = 0; h < 2; h++) {
            __m256 wv[4];
            for (int o = 0; o < OT; o++) wv[o] = _mm256_loadu_ps(w + o * ws + k + 8 * h);
            for (int r = 0; r < RT; r++) {
                const __m256 xv = _mm256_loadu_ps(x + r * xs + k + 8 * h);
                for (int o = 0; o < OT; o++) acc[r][o][h] = _mm256_fmadd_ps(wv[o], xv, acc[r][o][h]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) y[r * GROUP + o] = lane_sum(acc[r][o][0], acc[r][o][1]);
}
#else
static inline void tile(const float *w, int64_t ws, const float *x, int64_t xs, int Kp, const int RT,
                        const int OT, float *y) {
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) {
            float a[STEP] = {0};
            const float *wr = w + o * ws, *xr = x + r * xs;
            for (int k = 0; k < Kp; k += STEP)
                for (int l = 0; l < STEP; l++) a[l] += wr[k + l] * xr[k + l];
            for (int width = STEP / 2; width > 0; width /= 2) /* the same tree as lane_sum */
                for (int l = 0; l < width; l++) a[l] += a[l + width];
            y[r * GROUP + o] = a[0];
        }
}
#endif

/* y[r * GROUP + o] for rt rows and no outputs: each (rt, ot) an unrolled tile that fits the registers. */
static void tiles(const float *w, int64_t ws, const float *x, int64_t xs, int Kp, int rt, int no, float *y) {
    if (rt == 1) {
        switch (no) {
        case 1: tile(w, ws, x, xs, Kp, 1, 1, y); break;
        case 2: tile(w, ws, x, xs, Kp, 1, 2, y); break;
        case 3: tile(w, ws, x, xs, Kp, 1, 3, y); break;
        default: tile(w, ws, x, xs, Kp, 1, 4, y); break;
        }
        return;
    }
    for (int o = 0; o < no; o += 2) {
        const int two = no - o >= 2;
        if (rt == 2) {
            if (two) tile(w + o * ws, ws, x, xs, Kp, 2, 2, y + o);
            else tile(w + o * ws, ws, x, xs, Kp, 2, 1, y + o);
        } else {
            if (two) tile(w + o * ws, ws, x, xs, Kp, 3, 2, y + o);
            else tile(w + o * ws, ws, x, xs, Kp, 3, 1, y + o);
        }
    }
}

#if SIMD
/* RT input rows (rows of x xs floats apart) against OT weight rows, expanding each block of weights in
 * registers (no scratch): what a decode or a short verify does. Accumulates in the order of `tile` (acc 0
 * takes elements 0-7 and 16-23 of each block, acc 1 8-15 and 24-31), so a row gets the same bits here as
 * in a larger batch. y[r * GROUP + o]. */
static inline __attribute__((always_inline)) void row_tile(const int fmt, const uint8_t *w, int64_t row_bytes,
                                                           const float *x, int64_t xs, int Kp, const int RT,
                                                           const int OT, float *y) {
    vec acc[4][4][2]; /* RT x OT pairs in use, at most 4 (4 x 1, 2 x 2, 1 x 4): 8 of the 16 registers, the others
                       * hold the expanded block and its scale */
    float ks[4][16];
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) acc[r][o][0] = acc[r][o][1] = _mm256_setzero_ps();
    for (int b = 0; b < Kp / 32; b++) {
        if (fmt == FMT_Q4_K && b % 8 == 0)
            for (int o = 0; o < OT; o++) q4_k_scales(w + o * row_bytes + 144 * (b / 8), ks[o]);
        _Pragma("GCC unroll 4")
        for (int o = 0; o < OT; o++) {
            vec f[4];
            prefetch_block(fmt, w + (o + GROUP) * row_bytes, b);
            block32(fmt, w + o * row_bytes, b, f, ks[o]);
            for (int r = 0; r < RT; r++) {
                const float *xr = x + r * xs + 32 * b;
                acc[r][o][0] = _mm256_fmadd_ps(f[0], _mm256_loadu_ps(xr), acc[r][o][0]);
                acc[r][o][1] = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xr + 8), acc[r][o][1]);
                acc[r][o][0] = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xr + 16), acc[r][o][0]);
                acc[r][o][1] = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xr + 24), acc[r][o][1]);
            }
        }
    }
    for (int r = 0; r < RT; r++)
        for (int o = 0; o < OT; o++) y[r * GROUP + o] = lane_sum(acc[r][o][0], acc[r][o][1]);
}

static inline __attribute__((always_inline)) void row_group_fmt(const int fmt, const uint8_t *w, int64_t row_bytes,
                                                                int no, const float *x, int64_t xs, int rows,
                                                                int Kp, float *y) {
    if (rows == 1 && no == GROUP) {
        row_tile(fmt, w, row_bytes, x, xs, Kp, 1, GROUP, y);
        return;
    }
    if (rows == 1) {
        for (int o = 0; o < no; o++) row_tile(fmt, w + o * row_bytes, row_bytes, x, xs, Kp, 1, 1, y + o);
        return;
    }
    const int chunks = (rows + 3) / 4;
    for (int c = 0, r0 = 0; c < chunks; c++) {
        const int nr = (rows - r0) / (chunks - c); /* balanced: 7 rows -> 3, 4 */
        const float *xc = x + r0 * xs;
        float *yc = y + r0 * GROUP;
        if (nr == 2) /* chunks hold 2-4 rows: ceil(rows / 4) of them for 2-8 rows */
            for (int o = 0; o < no; o += 2) {
                if (no - o >= 2) row_tile(fmt, w + o * row_bytes, row_bytes, xc, xs, Kp, 2, 2, yc + o);
                else row_tile(fmt, w + o * row_bytes, row_bytes, xc, xs, Kp, 2, 1, yc + o);
            }
        else if (nr == 3)
            for (int o = 0; o < no; o++) row_tile(fmt, w + o * row_bytes, row_bytes, xc, xs, Kp, 3, 1, yc + o);
        else
            for (int o = 0; o < no; o++) row_tile(fmt, w + o * row_bytes, row_bytes, xc, xs, Kp, 4, 1, yc + o);
        r0 += nr;
    }
}

/* y[r * GROUP + o] for the no (<= GROUP) weight rows at w and rows (<= IN_REGISTERS) float32 input rows at x:
 * one row against four weight rows at once, more in balanced chunks of 2-4 rows (7 rows: 3, then 4). */
static void row_group(int fmt, const uint8_t *w, int64_t row_bytes, int no, const float *x, int64_t xs, int rows,
                      int Kp, float *y) {
    switch (fmt) {
    case FMT_F32: row_group_fmt(FMT_F32, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_BF16: row_group_fmt(FMT_BF16, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_Q8_0: row_group_fmt(FMT_Q8_0, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_Q4_0: row_group_fmt(FMT_Q4_0, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_Q4_1: row_group_fmt(FMT_Q4_1, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_Q4_K: row_group_fmt(FMT_Q4_K, w, row_bytes, no, x, xs, rows, Kp, y); break;
    case FMT_Q6_K: row_group_fmt(FMT_Q6_K, w, row_bytes, no, x, xs, rows, Kp, y); break;
    }
}
#endif

/* e^x in float32 (Cephes' expf: Cody-Waite reduction by ln 2, a degree-5 polynomial; within ~2 ulp of the
 * exact value, x clamped to [-87, 88]). Written in plain IEEE operations in a fixed order, so that the loop
 * in exp_negated vectorizes and a vector lane gives the same bits as the scalar code: an output's SwiGLU
 * does not depend on where it falls in a tile (batch invariance). Why not expf: libm's scalar calls took a
 * quarter of a 32-row gate/up projection (bench in docs/cpu-kernels.md). */
static inline float exp_fixed(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = (x * 1.44269504f + 12582912.f) - 12582912.f; /* round(x / ln 2): 1.5 2^23 drops the fraction */
    float r = fmaf(n, -0.693359375f, x);                          /* x - n ln 2, ln 2 in two parts */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float y = fmaf(p, r * r, r) + 1.f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n, n in [-126, 127] */
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* e[i] = exp(-g[i]) for i < n. */
static void exp_negated(const float *g, float *e, int n) {
    _Pragma("omp simd")
    for (int i = 0; i < n; i++) e[i] = exp_fixed(-g[i]);
}

#if SIMD
/* f32_to_bf16 (bf16.h) on 4 lanes, the same bits (NaN included), packed into the low 8 bytes. */
static inline __m128i bf16x4(__m128 v) {
    const __m128i u = _mm_castps_si128(v);
    const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
    const __m128i rounded = _mm_srli_epi32(_mm_add_epi32(_mm_add_epi32(u, _mm_set1_epi32(0x7fff)), lsb), 16);
    const __m128i nan = _mm_or_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(0x40));
    const __m128i is_nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7fffffff)), _mm_set1_epi32(0x7f800000));
    return _mm_packus_epi32(_mm_blendv_epi8(rounded, nan, is_nan), _mm_setzero_si128());
}
static inline __m128 bf16x4_f32(__m128i h) { return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16)); }
/* The four outputs of a row by STORE or ADD, as the scalar loop below computes them. */
static inline void four_bf16(uint16_t *p, __m128 v, int mode) {
    if (mode == MODE_ADD) v = _mm_add_ps(bf16x4_f32(_mm_loadl_epi64((const __m128i *)p)), bf16x4_f32(bf16x4(v)));
    _mm_storel_epi64((__m128i *)p, bf16x4(v));
}
static inline void four_f32(float *p, __m128 v, int mode) {
    _mm_storeu_ps(p, mode == MODE_ADD ? _mm_add_ps(_mm_loadu_ps(p), v) : v);
}
#define FOUR(SUFFIX, p, v, mode) four_##SUFFIX(p, v, mode)
#else /* never called: SIMD is 0 */
#define FOUR(SUFFIX, p, v, mode) ((void)0)
#endif

/* Writes the results y[i * ys + o] of rows i < rt, outputs o0 + o (o < no) by `mode`. SWIGLU: silu(g) =
 * g / (1 + exp(-g)) as torch computes it, on the rounded gate, times the rounded up, the exponentials of
 * the whole tile at once. STORE and ADD: four outputs at a time where SIMD, the rest one by one. */
#define DEFINE_EPILOGUE(T, SUFFIX)                                                                         \
static void epilogue_##SUFFIX(float *y, int ys, int rt, int no, T *out, int64_t out_stride, int o0,        \
                              const float *bias, int mode) {                                               \
    if (bias != NULL)                                                                                      \
        for (int i = 0; i < rt; i++)                                                                       \
            for (int o = 0; o < no; o++) y[i * ys + o] += bias[o0 + o];                                    \
    if (mode == MODE_SWIGLU) {                                                                             \
        float gate[ROW_BLOCK * SPAN / 2], up[ROW_BLOCK * SPAN / 2], e[ROW_BLOCK * SPAN / 2];               \
        int n = 0;                                                                                         \
        for (int i = 0; i < rt; i++)                                                                       \
            for (int o = 0; o + 1 < no; o += 2, n++) {                                                     \
                gate[n] = ROUND_##SUFFIX(y[i * ys + o]);                                                   \
                up[n] = ROUND_##SUFFIX(y[i * ys + o + 1]);                                                 \
            }                                                                                              \
        exp_negated(gate, e, n);                                                                           \
        _Pragma("omp simd")                                                                                \
        for (int j = 0; j < n; j++) e[j] = ROUND_##SUFFIX(gate[j] / (1.f + e[j])) * up[j];                 \
        n = 0;                                                                                             \
        for (int i = 0; i < rt; i++)                                                                       \
            for (int o = 0; o + 1 < no; o += 2) STORE_##SUFFIX(out + (int64_t)i * out_stride, (o0 + o) / 2, e[n++]); \
        return;                                                                                            \
    }                                                                                                      \
    for (int i = 0; i < rt; i++) {                                                                         \
        T *orow = out + (int64_t)i * out_stride;                                                           \
        const float *yr = y + i * ys;                                                                      \
        int o = 0;                                                                                         \
        if (SIMD)                                                                                          \
            for (; o + 4 <= no; o += 4) FOUR(SUFFIX, orow + o0 + o, _mm_loadu_ps(yr + o), mode);           \
        if (mode == MODE_STORE) {                                                                          \
            for (; o < no; o++) STORE_##SUFFIX(orow, o0 + o, yr[o]);                                       \
        } else {                                                                                           \
            for (; o < no; o++)                                                                            \
                STORE_##SUFFIX(orow, o0 + o, LOAD_##SUFFIX(orow, o0 + o) + ROUND_##SUFFIX(yr[o]));         \
        }                                                                                                  \
    }                                                                                                      \
}
DEFINE_EPILOGUE(uint16_t, bf16)
DEFINE_EPILOGUE(float, f32)

#if SIMD
#define ROW_GROUP row_group
#else /* never called: the portable build expands every row to scratch */
#define ROW_GROUP(...) ((void)0)
#endif

#define DEFINE_LINEAR(NAME, T, SUFFIX)                                                                     \
int NAME(const uint8_t *w, int32_t fmt, int64_t w_row_bytes, int32_t N, int32_t K, int32_t Kp,             \
         const T *x, int64_t x_stride, int32_t rows, const float *bias, T *out, int64_t out_stride,        \
         int32_t mode, int32_t num_threads) {                                                              \
    const int block = rows < ROW_BLOCK ? rows : ROW_BLOCK;                                                  \
    const int integer = fmt >= FMT_I4; /* rows quantized to int8 blocks (int8_dot.h) */                    \
    const int64_t xb = int8_x_bytes(Kp);                                                                   \
    float *xs = malloc(sizeof(float) * (size_t)block * Kp);                                                \
    uint8_t *xq = integer ? malloc((size_t)(block * xb)) : NULL;                                           \
    if (xs == NULL || (integer && xq == NULL)) {                                                           \
        free(xs);                                                                                          \
        return -1;                                                                                         \
    }                                                                                                      \
    /* A thread team costs a few microseconds: not worth it below ~50k multiply-adds. */                   \
    const int threads = (int64_t)N * K * rows >= 50000 ? num_threads : 1;                                  \
    /* Outputs a work item: GROUP on the exact path (its scratch); on the integer path up to SPAN, fewer   \
     * epilogue calls that vectorize across outputs, as long as every thread gets 4 items or more. */     \
    int span = integer ? SPAN : GROUP;                                                                     \
    while (span > GROUP && (N + span - 1) / span < 4 * threads) span /= 2;                                 \
    const int items = (N + span - 1) / span;                                                               \
    _Pragma("omp parallel num_threads(threads)")                                                           \
    {                                                                                                      \
        float wbuf[GROUP * Kp] __attribute__((aligned(32)));                                               \
        for (int r0 = 0; r0 < rows; r0 += block) {                                                         \
            const int nr = rows - r0 < block ? rows - r0 : block;                                          \
            _Pragma("omp for schedule(static)")                                                            \
            for (int r = 0; r < nr; r++) {                                                                 \
                const T *xr = x + (int64_t)(r0 + r) * x_stride;                                            \
                float *dst = xs + (int64_t)r * Kp;                                                         \
                for (int k = 0; k < K; k++) dst[k] = LOAD_##SUFFIX(xr, k);                                 \
                for (int k = K; k < Kp; k++) dst[k] = 0.f;                                                 \
                if (integer) int8_quantize_row(dst, Kp, xq + r * xb);                                      \
            }                                                                                              \
            _Pragma("omp for schedule(static)")                                                            \
            for (int g = 0; g < items; g++) {                                                              \
                const int o0 = g * span, no = N - o0 < span ? N - o0 : span;                               \
                const uint8_t *wg = w + (int64_t)o0 * w_row_bytes;                                         \
                T *og = out + (int64_t)r0 * out_stride;                                                    \
                if (integer) {                                                                             \
                    float y[ROW_BLOCK * SPAN];                                                             \
                    int8_rows(fmt - FMT_I4, wg, w_row_bytes, no, xq, xb, nr, Kp, y, SPAN);                 \
                    epilogue_##SUFFIX(y, SPAN, nr, no, og, out_stride, o0, bias, mode);                    \
                    continue;                                                                              \
                }                                                                                          \
                if (SIMD && nr <= IN_REGISTERS) { /* a decode or a short verify: expand in registers */    \
                    float y[IN_REGISTERS * GROUP];                                                         \
                    ROW_GROUP(fmt, wg, w_row_bytes, no, xs, Kp, nr, Kp, y);                                \
                    epilogue_##SUFFIX(y, GROUP, nr, no, og, out_stride, o0, bias, mode);                   \
                    continue;                                                                              \
                }                                                                                          \
                const float *wf = wbuf;                                                                    \
                int64_t ws = Kp;                                                                           \
                if (fmt == FMT_F32) { /* rows already float32 and padded: read them in place */            \
                    wf = (const float *)wg;                                                                \
                    ws = w_row_bytes / (int64_t)sizeof(float);                                             \
                } else {                                                                                   \
                    for (int i = 0; i < no; i++)                                                           \
                        expand_row(fmt, wg + (int64_t)i * w_row_bytes, Kp, wbuf + (int64_t)i * Kp,         \
                                   wg + (int64_t)(i + GROUP) * w_row_bytes);                               \
                }                                                                                          \
                for (int r = 0; r < nr;) {                                                                 \
                    const int rt = nr - r < MAX_RT ? nr - r : MAX_RT;                                      \
                    float y[MAX_RT * GROUP];                                                               \
                    tiles(wf, ws, xs + (int64_t)r * Kp, Kp, Kp, rt, no, y);                                \
                    epilogue_##SUFFIX(y, GROUP, rt, no, og + (int64_t)r * out_stride, out_stride, o0, bias, mode); \
                    r += rt;                                                                               \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
    free(xs);                                                                                              \
    free(xq);                                                                                              \
    return 0;                                                                                              \
}

DEFINE_LINEAR(linear_bf16, uint16_t, bf16)
DEFINE_LINEAR(linear_f32, float, f32)

/* The float32 matrix [N, K] the blocks hold (for tests and for torch paths), rows in parallel. */
void dequantize_rows(const uint8_t *w, int32_t fmt, int64_t w_row_bytes, int32_t N, int32_t K, float *out,
                     int32_t num_threads) {
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int n = 0; n < N; n++) expand_row(fmt, w + (int64_t)n * w_row_bytes, K, out + (int64_t)n * K, NULL);
}

/* The inputs Kp that a row of K inputs covers in format `to` (FMT_I4 .. FMT_I6), and its bytes. */
int64_t int8_layout(int32_t to, int32_t K, int32_t *Kp) {
    *Kp = int8_padded(K);
    return int8_w_bytes(to - FMT_I4, *Kp);
}

/* GGUF rows (fmt FMT_Q8_0 .. FMT_Q6_K, K inputs) -> rows of Kp inputs in format `to` (FMT_I4 .. FMT_I6: Q6_K
 * to FMT_I6, the others to the rest). Returns how many rows have a scale that the format's f16 scales cannot
 * hold (0: all fit). */
int pack_int8_rows(const uint8_t *w, int32_t fmt, int64_t w_row_bytes, int32_t N, int32_t K, int32_t Kp, int32_t to,
                   uint8_t *out, int64_t out_row_bytes, int32_t num_threads) {
    int misfits = 0;
    _Pragma("omp parallel for schedule(static) reduction(+:misfits) num_threads(num_threads)")
    for (int n = 0; n < N; n++)
        misfits += !int8_pack_row(fmt, to - FMT_I4, w + (int64_t)n * w_row_bytes, K, Kp,
                                  out + (int64_t)n * out_row_bytes);
    return misfits;
}
