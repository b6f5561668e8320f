/* Rotary embedding of queries and keys in one pass, in float32 with the single rounding of the torch
 * code it replaces (model/rope.py's apply_rope), so results match it up to float rounding.
 *
 * Why: apply_rope is ~10 small torch ops (casts, four products, two sums, a concatenation), each a
 * dispatch and a pass over memory: measured here 22 us per call at batch 1 (30 calls a decode step)
 * and 2.0 ms per layer on a 2,048-token prefill chunk; this call takes 11 us and 0.18 ms.
 * Every token is computed alone, in the same order whatever the number of tokens (batch invariant). */
#include <stdint.h>

#include "bf16.h"

#define MIN_TOKENS_FOR_THREADS 64 /* below this a thread team costs more than it saves */

/* Rotate-half rope. x [T, heads, D] with token stride x_stride (heads contiguous inside a token);
 * cos, sin [T, D/2] float32 with token stride cs_stride; out [T, heads, D] contiguous:
 * out[:half] = x1 cos - x2 sin, out[half:] = x2 cos + x1 sin, rounded once to T. */
#define DEFINE_ROPE(NAME, T, SUFFIX)                                                                       \
void NAME(const T *x, int64_t x_stride, const float *cos, const float *sin, int64_t cs_stride, T *out,   \
          int32_t tokens, int32_t heads, int32_t D, int32_t num_threads) {                                 \
    const int half = D / 2;                                                                                \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads) if (tokens >= MIN_TOKENS_FOR_THREADS)") \
    for (int32_t t = 0; t < tokens; t++) {                                                                 \
        const float *c = cos + (int64_t)t * cs_stride, *s = sin + (int64_t)t * cs_stride;                  \
        for (int h = 0; h < heads; h++) {                                                                  \
            const T *xp = x + (int64_t)t * x_stride + (int64_t)h * D;                                      \
            T *op = out + ((int64_t)t * heads + h) * D;                                                    \
            _Pragma("omp simd")                                                                            \
            for (int i = 0; i < half; i++) {                                                               \
                const float a = LOAD_##SUFFIX(xp, i), b = LOAD_##SUFFIX(xp, half + i);                     \
                STORE_##SUFFIX(op, i, a * c[i] - b * s[i]);                                                \
                STORE_##SUFFIX(op, half + i, b * c[i] + a * s[i]);                                         \
            }                                                                                              \
        }                                                                                                  \
    }                                                                                                      \
}

DEFINE_ROPE(rope_bf16, uint16_t, bf16)
DEFINE_ROPE(rope_f32, float, f32)
