/* Attention of short queries (decodes, verifies) over a paged KV cache, on the CPU.
 *
 * Why not torch ops: gathering each sequence's keys and values into a padded batch (index_select) and
 * multiplying it (bmm) moves every cached key three times per layer (read, write the copy, read it
 * again). Here each (sequence, KV head) reads its keys and values once, straight from the cache
 * through its block table, in float32 for the arithmetic.
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

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

#define LOAD_bf16(p, i) bf16_to_f32((p)[i])
#define STORE_bf16(p, i, x) ((p)[i] = f32_to_bf16(x))
#define LOAD_f32(p, i) ((p)[i])
#define STORE_f32(p, i, x) ((p)[i] = (x))

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

#define DEFINE_KERNEL(NAME, T, SUFFIX)                                                                     \
int NAME(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, const int32_t *seq_start,        \
         const int32_t *seq_qlen, const int32_t *seq_ctx, const int32_t *tables, int32_t table_stride,      \
         int32_t num_seqs, int32_t H, int32_t Hkv, int32_t D, int32_t block_size, float scale,             \
         int32_t window, int32_t num_threads) {                                                            \
    const int per_kv = H / Hkv;                                                                            \
    /* Keys go in aligned groups of GROUP, always whole (reading cache slots past the context inside the  \
     * last block; their weights are 0): then every key takes the same arithmetic path wherever the      \
     * context ends, and a query's output is the same in a decode and in a longer verify (lossless SD). */ \
    const int group = block_size % GROUP == 0 ? GROUP : 1;                                                 \
    int failed = 0;                                                                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                 \
    for (int s = 0; s < num_seqs; s++) {                                                                   \
        for (int g = 0; g < Hkv; g++) {                                                                    \
            const int ql = seq_qlen[s], ctx = seq_ctx[s], rows = ql * per_kv;                              \
            const int first_pos = ctx - ql;                                                                \
            int lo = 0; /* first key any row may see, rounded down to a group */                           \
            if (window > 0 && first_pos - window + 1 > 0) lo = first_pos - window + 1;                     \
            lo -= lo % group;                                                                              \
            const int hi = (ctx + group - 1) / group * group, n = hi - lo;                                 \
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
                for (int d = 0; d < D; d++) qf[r * D + d] = LOAD_##SUFFIX(qp, d) * scale;                   \
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
            for (int r = 0; r < rows; r++) { /* softmax over the row's own keys; weight 0 elsewhere */     \
                const int pos = first_pos + r / per_kv;                                                    \
                const int first = window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;               \
                float *row = sc + (size_t)r * row_floats;                                                  \
                total[r] = softmax_in_place(row + (first - lo), pos - first + 1);                          \
                for (int j = 0; j < first - lo; j++) row[j] = 0.f;                                         \
                for (int j = pos + 1 - lo; j < n; j++) row[j] = 0.f;                                       \
            }                                                                                              \
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

DEFINE_KERNEL(paged_attention_short_bf16, uint16_t, bf16)
DEFINE_KERNEL(paged_attention_short_f32, float, f32)
