/* bf16 <-> float32 and the per-dtype load/store macros the kernels share. */
#ifndef SPECSERVE_BF16_H
#define SPECSERVE_BF16_H
#include <stdint.h>
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
#define ROUND_bf16(x) bf16_to_f32(f32_to_bf16(x))
#define LOAD_f32(p, i) ((p)[i])
#define STORE_f32(p, i, x) ((p)[i] = (x))
#define ROUND_f32(x) (x)
#endif
