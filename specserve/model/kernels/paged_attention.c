/* Attention of short queries (decodes, verifies) over a paged KV cache, on the CPU.
 *
 * Why not torch ops: gathering each sequence's keys and values into a padded batch (index_select) and
 * multiplying it (bmm) reads and writes every cached key three times per layer, and a decode step's
 * attention is memory-bound. Here each (sequence, KV head) reads its keys and values once, straight
 * from the cache through its block table, in float32 for the arithmetic.
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

#define DEFINE_KERNEL(NAME, T, SUFFIX)                                                                     \
int NAME(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out, const int32_t *seq_start,        \
          const int32_t *seq_qlen, const int32_t *seq_ctx, const int32_t *tables, int32_t table_stride,     \
          int32_t num_seqs, int32_t H, int32_t Hkv, int32_t D, int32_t block_size, float scale,            \
          int32_t window, int32_t num_threads) {                                                           \
    const int per_kv = H / Hkv;                                                                            \
    int failed = 0;                                                                                        \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)")                 \
    for (int s = 0; s < num_seqs; s++) {                                                                   \
        for (int g = 0; g < Hkv; g++) {                                                                    \
            const int ql = seq_qlen[s], ctx = seq_ctx[s], rows = ql * per_kv;                              \
            const int first_pos = ctx - ql;                                                                \
            int lo = 0; /* first key any row may see */                                                    \
            if (window > 0 && first_pos - window + 1 > 0) lo = first_pos - window + 1;                     \
            const int n = ctx - lo;                                                                        \
            float *buf = malloc(sizeof(float) * ((size_t)rows * (2 * D + n + 1)));                         \
            if (buf == NULL) { failed = 1; continue; }                                                     \
            float *qf = buf, *acc = qf + (size_t)rows * D, *sc = acc + (size_t)rows * D;                   \
            float *total = sc + (size_t)rows * n;                                                          \
            /* row r: query token r / per_kv, query head g * per_kv + r % per_kv */                        \
            for (int r = 0; r < rows; r++) {                                                               \
                const T *qp = q + (int64_t)(seq_start[s] + r / per_kv) * q_stride                          \
                              + (int64_t)(g * per_kv + r % per_kv) * D;                                    \
                for (int d = 0; d < D; d++) qf[r * D + d] = LOAD_##SUFFIX(qp, d) * scale;                   \
            }                                                                                              \
            for (int j = lo; j < ctx;) { /* scores, 4 keys at a time (independent sums) where a block allows */ \
                const int32_t block = tables[(int64_t)s * table_stride + j / block_size];                  \
                const T *kp = kc + (((int64_t)block * Hkv + g) * block_size + j % block_size) * D;         \
                if (j % block_size + 4 <= block_size && j + 4 <= ctx) {                                    \
                    for (int r = 0; r < rows; r++) {                                                       \
                        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;                                      \
                        const float *qr = qf + r * D;                                                      \
                        _Pragma("omp simd reduction(+:d0,d1,d2,d3)")                                       \
                        for (int d = 0; d < D; d++) {                                                      \
                            d0 += qr[d] * LOAD_##SUFFIX(kp, d);                                            \
                            d1 += qr[d] * LOAD_##SUFFIX(kp, D + d);                                        \
                            d2 += qr[d] * LOAD_##SUFFIX(kp, 2 * D + d);                                    \
                            d3 += qr[d] * LOAD_##SUFFIX(kp, 3 * D + d);                                    \
                        }                                                                                  \
                        float *out_s = sc + (size_t)r * n + (j - lo);                                      \
                        out_s[0] = d0; out_s[1] = d1; out_s[2] = d2; out_s[3] = d3;                        \
                    }                                                                                      \
                    j += 4;                                                                                \
                    continue;                                                                              \
                }                                                                                          \
                for (int r = 0; r < rows; r++) {                                                           \
                    float dot = 0.f;                                                                       \
                    _Pragma("omp simd reduction(+:dot)")                                                   \
                    for (int d = 0; d < D; d++) dot += qf[r * D + d] * LOAD_##SUFFIX(kp, d);               \
                    sc[(size_t)r * n + (j - lo)] = dot;                                                    \
                }                                                                                          \
                j++;                                                                                       \
            }                                                                                              \
            for (int r = 0; r < rows; r++) { /* softmax over the row's own keys; 0 elsewhere */            \
                const int pos = first_pos + r / per_kv;                                                    \
                const int a = (window > 0 && pos - window + 1 > lo ? pos - window + 1 : lo) - lo;           \
                const int b = pos - lo; /* inclusive */                                                    \
                float *row = sc + (size_t)r * n, m = row[a], sum = 0.f;                                    \
                for (int j = a + 1; j <= b; j++) m = row[j] > m ? row[j] : m;                              \
                for (int j = 0; j < a; j++) row[j] = 0.f;                                                  \
                _Pragma("omp simd reduction(+:sum)")                                                       \
                for (int j = a; j <= b; j++) { row[j] = expf(row[j] - m); sum += row[j]; }                 \
                for (int j = b + 1; j < n; j++) row[j] = 0.f;                                              \
                total[r] = sum;                                                                            \
            }                                                                                              \
            memset(acc, 0, sizeof(float) * (size_t)rows * D);                                              \
            for (int j = lo; j < ctx;) { /* values, 4 at a time where a block allows (fewer acc updates) */ \
                const int32_t block = tables[(int64_t)s * table_stride + j / block_size];                  \
                const T *vp = vc + (((int64_t)block * Hkv + g) * block_size + j % block_size) * D;         \
                if (j % block_size + 4 <= block_size && j + 4 <= ctx) {                                    \
                    for (int r = 0; r < rows; r++) {                                                       \
                        const float *p = sc + (size_t)r * n + (j - lo);                                    \
                        float *ar = acc + r * D;                                                           \
                        _Pragma("omp simd")                                                                \
                        for (int d = 0; d < D; d++)                                                        \
                            ar[d] += p[0] * LOAD_##SUFFIX(vp, d) + p[1] * LOAD_##SUFFIX(vp, D + d)         \
                                   + p[2] * LOAD_##SUFFIX(vp, 2 * D + d) + p[3] * LOAD_##SUFFIX(vp, 3 * D + d); \
                    }                                                                                      \
                    j += 4;                                                                                \
                    continue;                                                                              \
                }                                                                                          \
                for (int r = 0; r < rows; r++) {                                                           \
                    const float p = sc[(size_t)r * n + (j - lo)];                                          \
                    _Pragma("omp simd")                                                                    \
                    for (int d = 0; d < D; d++) acc[r * D + d] += p * LOAD_##SUFFIX(vp, d);                \
                }                                                                                          \
                j++;                                                                                       \
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
