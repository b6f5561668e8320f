/* Attention of short queries (decodes, verifies) over a paged KV cache, on the CPU.
 *
 * Why not torch ops: gathering each sequence's keys and values into a padded batch (index_select) and
 * multiplying it (bmm) moves every cached key three times per layer (read, write the copy, read it
 * again). Here each (sequence, KV head) reads its keys and values once, straight from the cache
 * through its block table, in float32 for the arithmetic. Where the CPU has AVX512-BF16, bf16 caches
 * take a faster path (attend_bf16_fast below); the portable loop handles the rest.
 *
 * Shapes (row-major, element strides):
 *   q      [T, H, D] with row stride q_stride (queries of every token of the step, rope applied)
 *   kc, vc [num_blocks, Hkv, block_size, D]  (one layer's cache)
 *   out    [T, H * D]; only the rows of the listed sequences are written
 *   seq_start, seq_qlen, seq_ctx [S]: sequence s owns query rows seq_start[s] .. + seq_qlen[s] - 1,
 *          which sit at positions seq_ctx[s] - seq_qlen[s] .. seq_ctx[s] - 1 (their keys are cached)
 *   tables [S, table_stride]: cache blocks of each sequence
 * Query head h reads KV head h / (H / Hkv). A query at position p attends to keys j <= p, and with
 * window > 0 only to j > p - window. Returns 0, or -1 when scratch memory could not be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define GROUP 4 /* keys per group: four independent dot products, one accumulator update per four values */
#define CHUNK 16 /* softmax: exponentials and partial sums CHUNK at a time (one vector of float32) */

/* exp(x - max) in place over len scores, returns their sum. The split into CHUNKs and the order of
 * the partial sums depend only on len, so a query's weights come out the same in every call. */
static float softmax_in_place(float *x, int len) {
    float m = x[0];
    for (int i = 1; i < len; i++) m = x[i] > m ? x[i] : m;
    float part[CHUNK] = {0};
    const int full = len / CHUNK * CHUNK;
    for (int i = 0; i < full; i += CHUNK) {
        _Pragma("omp simd")
        for (int c = 0; c < CHUNK; c++) {
            x[i + c] = expf(x[i + c] - m);
            part[c] += x[i + c];
        }
    }
    for (int i = full; i < len; i++) {
        x[i] = expf(x[i] - m);
        part[i - full] += x[i];
    }
    for (int width = CHUNK / 2; width > 0; width /= 2)
        for (int c = 0; c < width; c++) part[c] += part[c + width];
    return part[0];
}

/* The first key a query at position pos may see (all keys, or the last `window` of them). */
static inline int first_visible(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* Keys [lo, hi) that any of a sequence's rows (positions first_pos .. ctx - 1) may see, widened to
 * whole aligned groups of `group` keys. */
static inline void key_range(int first_pos, int ctx, int window, int group, int *lo, int *hi) {
    *lo = first_visible(first_pos, window) / group * group;
    *hi = (ctx + group - 1) / group * group;
}

/* row: the scores of the query at position pos against keys lo .. lo + n - 1. Leaves its softmax
 * weights over the keys it may see, 0 elsewhere; returns the sum of the exponentials. */
static float weights_in_place(float *row, int lo, int n, int pos, int window) {
    const int first = first_visible(pos, window);
    const float total = softmax_in_place(row + (first - lo), pos - first + 1);
    for (int j = 0; j < first - lo; j++) row[j] = 0.f;
    for (int j = pos + 1 - lo; j < n; j++) row[j] = 0.f;
    return total;
}

/* ---- bf16 with AVX512-BF16 (vdpbf16ps: pairs of bf16 products summed into float32) ----
 * A 30-layer step's keys and values fit in no cache, so reading them is the floor. The portable loop
 * below stalls on each load and then spends as long again converting bf16 to float32; this path feeds
 * the cache's bf16 straight to the dot products and asks for the keys two blocks ahead. */
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define FAST_BF16 1
#define PREFETCH 32 /* keys ahead: a sequence's blocks lie anywhere in the cache, no prefetcher guesses them */

/* Starts loading the group of GROUP keys (or values) at key j of the sequence, if j < hi. A macro: gcc
 * deems a function holding only prefetches free of effects and drops its calls. */
#define PREFETCH_GROUP(cache, j)                                                                           \
    do {                                                                                                   \
        const int j_ = (j);                                                                                \
        if (j_ < hi) {                                                                                     \
            const char *p_ = (const char *)(cache + (((int64_t)table[j_ / block_size] * Hkv + g) * block_size \
                                                     + j_ % block_size) * D);                              \
            for (int off = 0; off < GROUP * D * 2; off += 64) __builtin_prefetch(p_ + off);                \
        }                                                                                                  \
    } while (0)

/* out[0..3] = lane sums of a0..a3, in a fixed order of pairwise adds (the same bits in every call). */
static inline void sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float *out) {
    const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 c01 = _mm512_add_ps(_mm512_permutex2var_ps(a0, lo8, a1), _mm512_permutex2var_ps(a0, hi8, a1));
    __m512 c23 = _mm512_add_ps(_mm512_permutex2var_ps(a2, lo8, a3), _mm512_permutex2var_ps(a2, hi8, a3));
    __m512 d = _mm512_add_ps(_mm512_permutex2var_ps(c01, lo4, c23), _mm512_permutex2var_ps(c01, hi4, c23));
    d = _mm512_add_ps(d, _mm512_permute_ps(d, 0x4e)); /* lanes 0-3: a0, 4-7: a2, 8-11: a1, 12-15: a3 */
    d = _mm512_add_ps(d, _mm512_permute_ps(d, 0xb1));
    float lanes[16];
    _mm512_storeu_ps(lanes, d);
    out[0] = lanes[0]; out[1] = lanes[8]; out[2] = lanes[4]; out[3] = lanes[12];
}

/* One (sequence s, KV head g); needs block_size % GROUP == 0 and D % 32 == 0. Scores: q . k in pairs
 * along D (q unscaled, exact in bf16; the scale after). Output: the weights p rounded to bf16 (as
 * torch's bf16 attention has them) in pairs along the keys, against two value rows interleaved by
 * unpacklo/hi: within each 32 values, lane i of the lo half holds d = 8 (i / 4) + i % 4, the hi half
 * d + 4. Arguments as in the kernel's comment at the top; table = sequence s's block table. */
static int attend_bf16_fast(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                            uint16_t *out, int start, int ql, int ctx, const int32_t *table, int H, int Hkv,
                            int D, int block_size, float scale, int window, int g) {
    const int per_kv = H / Hkv, rows = ql * per_kv, first_pos = ctx - ql, vecs = D / 32;
    int lo, hi;
    key_range(first_pos, ctx, window, GROUP, &lo, &hi);
    const int n = hi - lo;
    const size_t row_floats = ((size_t)n + 15) / 16 * 16;
    float *buf = aligned_alloc(64, sizeof(float) * (size_t)rows * (row_floats + D + 16));
    if (buf == NULL) return -1;
    float *sc = buf, *acc = sc + (size_t)rows * row_floats, *total = acc + (size_t)rows * D;
    const uint16_t *qrow[rows]; /* row r: query token r / per_kv, query head g * per_kv + r % per_kv */
    for (int r = 0; r < rows; r++)
        qrow[r] = q + (int64_t)(start + r / per_kv) * q_stride + (int64_t)(g * per_kv + r % per_kv) * D;

    for (int j = lo; j < lo + PREFETCH; j += GROUP) PREFETCH_GROUP(kc, j);
    for (int j = lo; j < hi; j += GROUP) { /* scores */
        PREFETCH_GROUP(kc, j + PREFETCH);
        const uint16_t *kp = kc + (((int64_t)table[j / block_size] * Hkv + g) * block_size + j % block_size) * D;
        for (int r = 0; r < rows; r++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int c = 0; c < vecs; c++) {
                const __m512bh qv = (__m512bh)_mm512_loadu_si512(qrow[r] + 32 * c);
                a0 = _mm512_dpbf16_ps(a0, qv, (__m512bh)_mm512_loadu_si512(kp + 32 * c));
                a1 = _mm512_dpbf16_ps(a1, qv, (__m512bh)_mm512_loadu_si512(kp + D + 32 * c));
                a2 = _mm512_dpbf16_ps(a2, qv, (__m512bh)_mm512_loadu_si512(kp + 2 * D + 32 * c));
                a3 = _mm512_dpbf16_ps(a3, qv, (__m512bh)_mm512_loadu_si512(kp + 3 * D + 32 * c));
            }
            float *sr = sc + (size_t)r * row_floats + (j - lo);
            sum4(a0, a1, a2, a3, sr);
            for (int i = 0; i < GROUP; i++) sr[i] *= scale;
        }
    }
    for (int j = lo; j < lo + PREFETCH; j += GROUP) PREFETCH_GROUP(vc, j);
    for (int r = 0; r < rows; r++) { /* weights; then as bf16 pairs, in place */
        float *row = sc + (size_t)r * row_floats;
        total[r] = weights_in_place(row, lo, n, first_pos + r / per_kv, window);
        uint32_t *pairs = (uint32_t *)row; /* pair i overwrites float i, read from floats 2i, 2i + 1 */
        for (int i = 0; i < n / 2; i++)
            pairs[i] = f32_to_bf16(row[2 * i]) | (uint32_t)f32_to_bf16(row[2 * i + 1]) << 16;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * D);
    for (int j = lo; j < hi; j += GROUP) { /* values */
        PREFETCH_GROUP(vc, j + PREFETCH);
        const uint16_t *vp = vc + (((int64_t)table[j / block_size] * Hkv + g) * block_size + j % block_size) * D;
        for (int c = 0; c < vecs; c++) {
            const __m512i v0 = _mm512_loadu_si512(vp + 32 * c), v1 = _mm512_loadu_si512(vp + D + 32 * c);
            const __m512i v2 = _mm512_loadu_si512(vp + 2 * D + 32 * c), v3 = _mm512_loadu_si512(vp + 3 * D + 32 * c);
            const __m512bh lo01 = (__m512bh)_mm512_unpacklo_epi16(v0, v1), hi01 = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
            const __m512bh lo23 = (__m512bh)_mm512_unpacklo_epi16(v2, v3), hi23 = (__m512bh)_mm512_unpackhi_epi16(v2, v3);
            for (int r = 0; r < rows; r++) {
                const uint32_t *pairs = (const uint32_t *)(sc + (size_t)r * row_floats) + (j - lo) / 2;
                const __m512bh p01 = (__m512bh)_mm512_set1_epi32((int)pairs[0]);
                const __m512bh p23 = (__m512bh)_mm512_set1_epi32((int)pairs[1]);
                float *ar = acc + (size_t)r * D + 32 * c;
                _mm512_store_ps(ar, _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_load_ps(ar), p01, lo01), p23, lo23));
                _mm512_store_ps(ar + 16, _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_load_ps(ar + 16), p01, hi01), p23, hi23));
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        uint16_t *op = out + (int64_t)(start + r / per_kv) * H * D + (int64_t)(g * per_kv + r % per_kv) * D;
        const float inv = 1.f / total[r], *ar = acc + (size_t)r * D;
        for (int d = 0; d < D; d++) { /* undo the interleave */
            const int i = d % 32, half = i % 8 / 4, lane = 4 * (i / 8) + i % 4;
            op[d] = f32_to_bf16(ar[d - i + 16 * half + lane] * inv);
        }
    }
    free(buf);
    return 0;
}
#else
#define FAST_BF16 0
static int attend_bf16_fast(const uint16_t *q, int64_t q_stride, const uint16_t *kc, const uint16_t *vc,
                            uint16_t *out, int start, int ql, int ctx, const int32_t *table, int H, int Hkv,
                            int D, int block_size, float scale, int window, int g) {
    return -1; /* never called: FAST_BF16 is 0 */
}
#endif

/* ---- the portable loop: float32 arithmetic, bf16 or float32 caches ---- */

#define DEFINE_KERNEL(NAME, T, SUFFIX, FAST)                                                               \
int NAME(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, const int32_t *seq_start,        \
         const int32_t *seq_qlen, const int32_t *seq_ctx, const int32_t *tables, int32_t table_stride,     \
         int32_t num_seqs, int32_t H, int32_t Hkv, int32_t D, int32_t block_size, float scale,             \
         int32_t window, int32_t num_threads) {                                                            \
    const int per_kv = H / Hkv;                                                                            \
    /* Keys go in aligned groups of GROUP, always whole (reading cache slots past the context inside the  \
     * last block; their weights are 0): then every key takes the same arithmetic path wherever the        \
     * context ends, and a query's output is the same in a decode and in a longer verify (lossless SD). */ \
    const int group = block_size % GROUP == 0 ? GROUP : 1;                                                 \
    int failed = 0;                                                                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                 \
    for (int s = 0; s < num_seqs; s++) {                                                                   \
        for (int g = 0; g < Hkv; g++) {                                                                    \
            if (FAST && group == GROUP && D % 32 == 0) {                                                   \
                if (attend_bf16_fast((const uint16_t *)q, q_stride, (const uint16_t *)kc,                  \
                                     (const uint16_t *)vc, (uint16_t *)out, seq_start[s], seq_qlen[s],     \
                                     seq_ctx[s], tables + (int64_t)s * table_stride, H, Hkv, D,            \
                                     block_size, scale, window, g) != 0)                                   \
                    failed = 1;                                                                            \
                continue;                                                                                  \
            }                                                                                              \
            const int ql = seq_qlen[s], ctx = seq_ctx[s], rows = ql * per_kv;                              \
            const int first_pos = ctx - ql;                                                                \
            int lo, hi;                                                                                    \
            key_range(first_pos, ctx, window, group, &lo, &hi);                                            \
            const int n = hi - lo;                                                                         \
            /* 64-byte aligned rows (D is a multiple of 16 in every supported model): vector loops then   \
             * split the same way in every call, so the rounding does not depend on where malloc put us. */ \
            const size_t row_floats = ((size_t)n + 15) / 16 * 16;                                          \
            const size_t floats = (size_t)rows * (2 * D + row_floats + 16);                                \
            float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);                       \
            if (buf == NULL) { failed = 1; continue; }                                                     \
            float *qf = buf, *acc = qf + (size_t)rows * D, *sc = acc + (size_t)rows * D;                   \
            float *total = sc + (size_t)rows * row_floats;                                                 \
            /* row r: query token r / per_kv, query head g * per_kv + r % per_kv */                        \
            for (int r = 0; r < rows; r++) {                                                               \
                const T *qp = q + (int64_t)(seq_start[s] + r / per_kv) * q_stride                          \
                              + (int64_t)(g * per_kv + r % per_kv) * D;                                    \
                for (int d = 0; d < D; d++) qf[r * D + d] = LOAD_##SUFFIX(qp, d) * scale;                  \
            }                                                                                              \
            for (int j = lo; j < hi; j += group) { /* scores: each key read once for all rows */           \
                const int32_t block = tables[(int64_t)s * table_stride + j / block_size];                  \
                const T *kp = kc + (((int64_t)block * Hkv + g) * block_size + j % block_size) * D;         \
                for (int r = 0; r < rows; r++) {                                                           \
                    const float *qr = qf + r * D;                                                          \
                    float *sr = sc + (size_t)r * row_floats + (j - lo);                                    \
                    if (group == GROUP) { /* GROUP independent dot products */                             \
                        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;                                      \
                        _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                                       \
                        for (int d = 0; d < D; d++) {                                                      \
                            d0 += qr[d] * LOAD_##SUFFIX(kp, d);                                            \
                            d1 += qr[d] * LOAD_##SUFFIX(kp, D + d);                                        \
                            d2 += qr[d] * LOAD_##SUFFIX(kp, 2 * D + d);                                    \
                            d3 += qr[d] * LOAD_##SUFFIX(kp, 3 * D + d);                                    \
                        }                                                                                  \
                        sr[0] = d0; sr[1] = d1; sr[2] = d2; sr[3] = d3;                                    \
                    } else {                                                                               \
                        float dot = 0.f;                                                                   \
                        _Pragma("omp simd reduction(+:dot)")                                               \
                        for (int d = 0; d < D; d++) dot += qr[d] * LOAD_##SUFFIX(kp, d);                   \
                        sr[0] = dot;                                                                       \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < rows; r++)                                                                 \
                total[r] = weights_in_place(sc + (size_t)r * row_floats, lo, n, first_pos + r / per_kv,    \
                                            window);                                                       \
            memset(acc, 0, sizeof(float) * (size_t)rows * D);                                              \
            for (int j = lo; j < hi; j += group) { /* values: each read once for all rows */               \
                const int32_t block = tables[(int64_t)s * table_stride + j / block_size];                  \
                const T *vp = vc + (((int64_t)block * Hkv + g) * block_size + j % block_size) * D;         \
                for (int r = 0; r < rows; r++) {                                                           \
                    const float *p = sc + (size_t)r * row_floats + (j - lo);                               \
                    float *ar = acc + r * D;                                                               \
                    if (group == GROUP) {                                                                  \
                        _Pragma("omp simd")                                                                \
                        for (int d = 0; d < D; d++)                                                        \
                            ar[d] += p[0] * LOAD_##SUFFIX(vp, d) + p[1] * LOAD_##SUFFIX(vp, D + d)         \
                                   + p[2] * LOAD_##SUFFIX(vp, 2 * D + d) + p[3] * LOAD_##SUFFIX(vp, 3 * D + d); \
                    } else {                                                                               \
                        _Pragma("omp simd")                                                                \
                        for (int d = 0; d < D; d++) ar[d] += p[0] * LOAD_##SUFFIX(vp, d);                  \
                    }                                                                                      \
                }                                                                                          \
            }                                                                                              \
            for (int r = 0; r < rows; r++) {                                                               \
                T *op = out + (int64_t)(seq_start[s] + r / per_kv) * H * D                                 \
                        + (int64_t)(g * per_kv + r % per_kv) * D;                                          \
                const float inv = 1.f / total[r];                                                          \
                for (int d = 0; d < D; d++) STORE_##SUFFIX(op, d, acc[r * D + d] * inv);                   \
            }                                                                                              \
            free(buf);                                                                                     \
        }                                                                                                  \
    }                                                                                                      \
    return failed ? -1 : 0;                                                                                \
}

DEFINE_KERNEL(paged_attention_short_bf16, uint16_t, bf16, FAST_BF16)
DEFINE_KERNEL(paged_attention_short_f32, float, f32, 0)

/* The new tokens' keys and values into the cache: token t's KV head g goes to its slot's row of
 * [num_blocks, Hkv, block_size, D]. k, v: [T, Hkv, D] rows with token strides k_stride, v_stride (in
 * elements of elem_size bytes); slots: [T] (block * block_size + offset). What index_copy_ does in
 * paged_attention's torch code, without its two dispatches per layer. */
void kv_write(const uint8_t *k, int64_t k_stride, const uint8_t *v, int64_t v_stride, uint8_t *kc, uint8_t *vc,
              const int64_t *slots, int32_t tokens, int32_t Hkv, int32_t D, int32_t block_size, int32_t elem_size) {
    const size_t row = (size_t)D * elem_size;
    for (int32_t t = 0; t < tokens; t++) {
        const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
        for (int32_t g = 0; g < Hkv; g++) {
            const int64_t dst = ((block * Hkv + g) * block_size + offset) * (int64_t)row;
            memcpy(kc + dst, k + (t * k_stride + (int64_t)g * D) * elem_size, row);
            memcpy(vc + dst, v + (t * v_stride + (int64_t)g * D) * elem_size, row);
        }
    }
}
