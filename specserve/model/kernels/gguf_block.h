/* What the linear kernels read from GGUF blocks: f16 scales, Q4_K's packed 6-bit scales and mins, Q6_K's
 * split 6-bit weights. */
#ifndef SPECSERVE_GGUF_BLOCK_H
#define SPECSERVE_GGUF_BLOCK_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define GGUF_SIMD 1
#else
#define GGUF_SIMD 0
#endif

static inline float f16_to_f32(uint16_t h) {
#if GGUF_SIMD
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0x1f) u = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0) u = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) u = sign;
    else { /* subnormal: shift the mantissa up to its leading one */
        exp = 113;
        while (!(mant & 0x400u)) { mant <<= 1; exp--; }
        u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline uint16_t read_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* Q4_K: the 8 sub-block scales (d sc) and negated mins -(dmin m) of the super-block at p, as float32
 * (exact). The 6-bit values unpack as in ggml's get_scale_min_k4, four at a time (its utmp trick). */
static inline void q4_k_scales(const uint8_t *p, float *ks) {
    const float d = f16_to_f32(read_u16(p)), dmin = f16_to_f32(read_u16(p + 2));
    uint32_t s[3], sc[2], mn[2];
    memcpy(s, p + 4, 12);
    sc[0] = s[0] & 0x3f3f3f3fu;
    mn[0] = s[1] & 0x3f3f3f3fu;
    sc[1] = (s[2] & 0x0f0f0f0fu) | ((s[0] >> 2) & 0x30303030u);
    mn[1] = ((s[2] >> 4) & 0x0f0f0f0fu) | ((s[1] >> 2) & 0x30303030u);
#if GGUF_SIMD
    const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc)));
    const __m256 mnf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn)));
    _mm256_storeu_ps(ks, _mm256_mul_ps(scf, _mm256_set1_ps(d)));
    _mm256_storeu_ps(ks + 8, _mm256_mul_ps(mnf, _mm256_set1_ps(-dmin))); /* -(dmin m) == (-dmin) m */
#else
    const uint8_t *scb = (const uint8_t *)sc, *mnb = (const uint8_t *)mn;
    for (int j = 0; j < 8; j++) {
        ks[j] = d * (float)scb[j];
        ks[8 + j] = -dmin * (float)mnb[j];
    }
#endif
}

/* Q6_K super-block of 256 (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one
 * per 16 weights), f16 d; w = (d sc) (q - 32). Block j (weights 32 j .. 32 j + 31) of the super-block at p:
 * its 6-bit q[32], laid out as ggml's dequantize_row_q6_K reads them (half n = j / 4 of the super-block,
 * quarter k = j % 4: ql byte 64 n + 32 (k % 2) + l, nibble k / 2; qh byte 32 n + l, bits 2 k). */
static inline void q6_k_block(const uint8_t *p, int j, uint8_t *q) {
    const int n = j / 4, k = j % 4;
    const uint8_t *ql = p + 64 * n + 32 * (k % 2), *qh = p + 128 + 32 * n;
    for (int l = 0; l < 32; l++)
        q[l] = (uint8_t)(((ql[l] >> (4 * (k / 2))) & 0x0f) | ((qh[l] >> (2 * k)) & 0x03) << 4);
}

#endif
