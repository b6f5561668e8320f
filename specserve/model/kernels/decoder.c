/* Every decoder layer of a step in one call: RMSNorm, fused q/k/v projection, rope, the cache write,
 * attention, o projection added into the residual, RMSNorm, gate/up projection with SwiGLU, down
 * projection added into the residual, for each layer in turn, by the other kernels of this library.
 *
 * Why: from Python these are nine calls per layer, ~4 us each through ctypes on this machine (1.1 ms
 * per step of a 30-layer model, next to a 10-20 ms forward); here they are one. The arithmetic is that
 * of the separate calls (model/cpu_forward.py's docstring), so the results are the same bits.
 *
 * Buffers (row-major, contiguous): x [T, hidden] (the residual stream, updated in place); h [T, hidden];
 * qkv [T, (H + 2 Hkv) D]; qk [T, H + Hkv, D]; attn [T, H D]; act [T, inter]. The cache of layer i is
 * kv_base + 2 i cache_bytes (keys), + cache_bytes more (values). */
#include <stdint.h>

#include "bf16.h"
#include "decoder.h"

void kv_write(const uint8_t *k, int64_t k_stride, const uint8_t *v, int64_t v_stride, uint8_t *kc, uint8_t *vc,
              const int64_t *slots, int32_t tokens, int32_t Hkv, int32_t D, int32_t block_size, int32_t elem_size);

#define DEFINE_DECODER(NAME, T, SUFFIX)                                                                    \
void rms_norm_##SUFFIX(const T *x, int64_t x_stride, const T *w, T *out, int32_t rows, int32_t dim, float eps, \
                       int32_t num_threads);                                                               \
void rope_##SUFFIX(const T *x, int64_t x_stride, const float *cos, const float *sin, int64_t cs_stride,   \
                   T *out, int32_t tokens, int32_t heads, int32_t D, int32_t num_threads);                 \
int linear_##SUFFIX(const uint8_t *w, int32_t fmt, int64_t w_row_bytes, int32_t N, int32_t K, int32_t Kp,  \
                    const T *x, int64_t x_stride, int32_t rows, const float *bias, T *out, int64_t out_stride, \
                    int32_t mode, int32_t num_threads);                                                    \
int paged_attention_short_##SUFFIX(const T *q, int64_t q_stride, const T *kc, const T *vc, T *out,         \
                                   const int32_t *seq_start, const int32_t *seq_qlen, const int32_t *seq_ctx, \
                                   const int32_t *tables, int32_t table_stride, int32_t num_seqs, int32_t H,  \
                                   int32_t Hkv, int32_t D, int32_t block_size, float scale, int32_t window,   \
                                   int32_t num_threads);                                                   \
                                                                                                           \
/* A projection, part after part (each its own outputs' columns; never SWIGLU, whose pairs one part holds). */ \
static int run_linear_##SUFFIX(const LinearArgs *a, const T *x, int64_t x_stride, int32_t rows, T *out,   \
                               int64_t out_stride, int32_t mode, int32_t threads) {                        \
    int status = 0;                                                                                        \
    for (; a != NULL; out += a->n, a = a->next)                                                            \
        status |= linear_##SUFFIX(a->w, a->fmt, a->row_bytes, a->n, a->k, a->kp, x, x_stride, rows, a->bias, \
                                  out, out_stride, mode, threads);                                         \
    return status;                                                                                         \
}                                                                                                          \
                                                                                                           \
int NAME(const LayerArgs *layers, int32_t num_layers, T *x, int32_t tokens, int32_t hidden, T *h, T *qkv,  \
         T *qk, T *attn, T *act, int32_t H, int32_t Hkv, int32_t D, int32_t inter, const float *cos,       \
         const float *sin, int64_t cs_stride, uint8_t *kv_base, int64_t cache_bytes, const int64_t *slots, \
         int32_t block_size, const int32_t *seqs, int32_t num_seqs, const int32_t *tables,                 \
         int32_t table_stride, int32_t window, int32_t threads) {                                          \
    const int32_t q_size = H * D, kv_size = Hkv * D, qkv_size = q_size + 2 * kv_size, qk_row = (H + Hkv) * D; \
    int status = 0;                                                                                        \
    for (int32_t i = 0; i < num_layers && status == 0; i++) {                                              \
        const LayerArgs *l = layers + i;                                                                   \
        uint8_t *kc = kv_base + 2 * (int64_t)i * cache_bytes, *vc = kc + cache_bytes;                      \
        rms_norm_##SUFFIX(x, hidden, (const T *)l->norm1, h, tokens, hidden, l->eps1, threads);            \
        status |= run_linear_##SUFFIX(&l->qkv, h, hidden, tokens, qkv, qkv_size, MODE_STORE, threads);     \
        rope_##SUFFIX(qkv, qkv_size, cos, sin, cs_stride, qk, tokens, H + Hkv, D, threads);                \
        kv_write((const uint8_t *)(qk + q_size), qk_row, (const uint8_t *)(qkv + q_size + kv_size), qkv_size, \
                 kc, vc, slots, tokens, Hkv, D, block_size, (int32_t)sizeof(T));                           \
        status |= paged_attention_short_##SUFFIX(qk, qk_row, (const T *)kc, (const T *)vc, attn, seqs,     \
                                                 seqs + num_seqs, seqs + 2 * num_seqs, tables, table_stride,  \
                                                 num_seqs, H, Hkv, D, block_size, l->scale, window, threads); \
        status |= run_linear_##SUFFIX(&l->o, attn, q_size, tokens, x, hidden, MODE_ADD, threads);          \
        rms_norm_##SUFFIX(x, hidden, (const T *)l->norm2, h, tokens, hidden, l->eps2, threads);            \
        status |= run_linear_##SUFFIX(&l->gate_up, h, hidden, tokens, act, inter, MODE_SWIGLU, threads);   \
        status |= run_linear_##SUFFIX(&l->down, act, inter, tokens, x, hidden, MODE_ADD, threads);         \
    }                                                                                                      \
    return status;                                                                                         \
}

DEFINE_DECODER(decoder_layers_bf16, uint16_t, bf16)
DEFINE_DECODER(decoder_layers_f32, float, f32)
