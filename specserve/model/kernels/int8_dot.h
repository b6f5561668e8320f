/* Integer dot products for 4-bit and 8-bit weights (included by linear.c, its formats FMT_I4, FMT_I8).
 *
 * Why: expanding weights to float32 costs more arithmetic per row than the multiply-adds themselves, so
 * 32 rows cost ~10x one row. Here each row of x is quantized once per call to int8 in blocks of 32
 * (as llama.cpp's q8 activations), and a block's dot product with 32 weights is an exact int32 sum:
 * vpdpbusd (AVX-512 VNNI / AVX-VNNI) multiplies 4 unsigned weight bytes by 4 signed activation bytes
 * and adds them into one int32 lane; AVX2 without VNNI gets the same int32 from maddubs + madd, and the
 * portable C from plain loops. Every path computes the same integers and then the same float32 steps in
 * the same order, so all give the same bits, and a row's result never depends on the other rows
 * (batch invariance, whatever the tiling).
 *
 * Glossary. A weight block b of 32 weights w_i = dw_b u_i + m_b with u_i unsigned integers (Q4_0:
 * u = q, m = -8 dw; Q4_1: m = its min; Q4_K: dw = d sc_j, m = -dmin m_j; Q8_0: u = q + 128,
 * m = -128 dw; all exact in float32). An activation block: x_i ~ da a_i, a_i = round(x_i / da) in
 * [-127, 127], da = max|x| / 127; s = da sum(a). Then sum_i w_i x_i ~ dw (da D) + m s, D = sum_i u_i a_i.
 *
 * Layout, "lanes are blocks": a group is 8 consecutive blocks (256 inputs; K is padded with zero blocks
 * to a multiple of 256), and one 256-bit vector holds 4 consecutive bytes of each of the 8 blocks, lane j
 * for block j, so that 8 vpdpbusd leave block j's D in lane j and the float32 step runs 8 blocks at a
 * time: f = fma(float(D) * da, dw, f); f = fma(m, s, f). The 8 lanes of f are summed at the end in one
 * fixed tree: ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)).
 *   weight row, per group (GROUP_I4 / GROUP_I8 bytes): the integers, then dw[8], then m[8] (float32).
 *     I4: 4 chunks of 32 bytes; byte 4j + i of chunk c holds u[block j][8c + i] (low nibble) and
 *     u[block j][8c + 4 + i] (high). I8: 8 chunks of 32 bytes; byte 4j + i of chunk t: u[block j][4t + i].
 *   activation row, per group (GROUP_X bytes): 8 steps of 32 bytes, byte 4j + i of step t:
 *     a[block j][4t + i]; then da[8], s[8] (float32), sum(a)[8] (int32). */
#ifndef SPECSERVE_INT8_DOT_H
#define SPECSERVE_INT8_DOT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_block.h"

enum { GROUP_IN = 256, GROUP_I4 = 192, GROUP_I8 = 320, GROUP_X = 352 };

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define INT_SIMD 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, a) _mm256_dpbusd_epi32(acc, u, a)
#define VNNI 1
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, a) _mm256_dpbusd_avx_epi32(acc, u, a)
#define VNNI 1
#else
#define VNNI 0
#endif
/* Rows per tile (each weight chunk unpacked once for all of them): int32 and float32 accumulators per
 * row fit 32 vector registers with AVX-512 (VL: ymm16-31), 16 without. */
#if defined(__AVX512VL__)
#define INT_ROWS 8
#else
#define INT_ROWS 4
#endif
#else
#define INT_SIMD 0
#define INT_ROWS 4
#endif

static inline int64_t int8_x_bytes(int Kp) { return (int64_t)(Kp / GROUP_IN) * GROUP_X; }

/* ---- activations: one float32 row (Kp values, zero past K) -> its quantized row ---- */
static void int8_quantize_row(const float *x, int Kp, uint8_t *dst) {
    for (int g = 0; g < Kp / GROUP_IN; g++) {
        uint8_t *xg = dst + (int64_t)g * GROUP_X;
        float *da = (float *)(xg + 256), *s = da + 8;
        int32_t *sum = (int32_t *)(s + 8);
        for (int j = 0; j < 8; j++) {
            const float *xb = x + (int64_t)g * GROUP_IN + 32 * j;
            int8_t q[32];
#if INT_SIMD
            __m256 v[4], amax = _mm256_setzero_ps();
            const __m256 sign = _mm256_set1_ps(-0.f);
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
            const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
            __m256i n[4];
            for (int i = 0; i < 4; i++) n[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id)); /* nearest, ties even */
            const __m256i t = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
            __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
            t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
            sum[j] = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1)));
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            sum[j] = 0;
            for (int i = 0; i < 32; i++) {
                q[i] = (int8_t)nearbyintf(xb[i] * id);
                sum[j] += q[i];
            }
#endif
            da[j] = d;
            s[j] = d * (float)sum[j];
            for (int t = 0; t < 8; t++) memcpy(xg + 32 * t + 4 * j, q + 4 * t, 4);
        }
    }
}

/* ---- weights: GGUF blocks -> the layout above (at load) and back to float32 (for tests) ---- */

/* Block b of a GGUF row as integers u[32], scale and offset (fmt: linear.c's FMT_Q8_0 .. FMT_Q4_K codes). */
static void gguf_block_ints(int fmt, const uint8_t *row, int b, uint8_t *u, float *dw, float *m) {
    if (fmt == 2) { /* Q8_0 */
        const uint8_t *p = row + 34 * b;
        *dw = f16_to_f32(read_u16(p));
        *m = -128.f * *dw;
        for (int i = 0; i < 32; i++) u[i] = (uint8_t)(p[2 + i] ^ 0x80); /* q + 128 */
    } else if (fmt == 3 || fmt == 4) { /* Q4_0, Q4_1: weight i < 16 in the low nibble of byte i, 16 + i high */
        const uint8_t *p = row + (fmt == 3 ? 18 : 20) * b, *qs = p + (fmt == 3 ? 2 : 4);
        *dw = f16_to_f32(read_u16(p));
        *m = fmt == 3 ? -8.f * *dw : f16_to_f32(read_u16(p + 2));
        for (int i = 0; i < 16; i++) {
            u[i] = qs[i] & 0x0f;
            u[16 + i] = qs[i] >> 4;
        }
    } else { /* Q4_K: sub-block j of 8, in the low (j even) or high nibbles of 32 bytes */
        const uint8_t *p = row + 144 * (b / 8), *qs = p + 16 + 32 * ((b % 8) / 2);
        float ks[16];
        q4_k_scales(p, ks);
        *dw = ks[b % 8];
        *m = ks[8 + b % 8];
        for (int i = 0; i < 32; i++) u[i] = b % 2 ? qs[i] >> 4 : qs[i] & 0x0f;
    }
}

/* One GGUF row of K inputs -> an I4 (4-bit formats) or I8 (Q8_0) row of Kp inputs, zero blocks past K. */
static void int8_pack_row(int fmt, const uint8_t *row, int K, int Kp, uint8_t *dst) {
    const int i8 = fmt == 2, gb = i8 ? GROUP_I8 : GROUP_I4;
    memset(dst, 0, (size_t)(Kp / GROUP_IN) * gb);
    for (int b = 0; b < K / 32; b++) {
        uint8_t u[32];
        uint8_t *wg = dst + (int64_t)(b / 8) * gb;
        const int j = b % 8;
        float *dw = (float *)(wg + (i8 ? 256 : 128)), *m = dw + 8;
        gguf_block_ints(fmt, row, b, u, dw + j, m + j);
        for (int i = 0; i < 4; i++)
            if (i8)
                for (int t = 0; t < 8; t++) wg[32 * t + 4 * j + i] = u[4 * t + i];
            else
                for (int c = 0; c < 4; c++) wg[32 * c + 4 * j + i] = (uint8_t)(u[8 * c + i] | u[8 * c + 4 + i] << 4);
    }
}

/* The float32 values dw u + m of an I4/I8 row's first K inputs (equal to the GGUF block's own). */
static void int8_dequantize_row(int i8, const uint8_t *row, int K, float *dst) {
    const int gb = i8 ? GROUP_I8 : GROUP_I4;
    for (int b = 0; b < K / 32; b++) {
        const uint8_t *wg = row + (int64_t)(b / 8) * gb;
        const int j = b % 8;
        const float *dw = (const float *)(wg + (i8 ? 256 : 128)), *m = dw + 8;
        for (int i = 0; i < 32; i++) {
            const uint8_t u = i8 ? wg[32 * (i / 4) + 4 * j + i % 4]
                                 : (wg[32 * (i / 8) + 4 * j + i % 4] >> (i % 8 >= 4 ? 4 : 0)) & 0x0f;
            dst[32 * b + i] = fmaf(dw[j], (float)u, m[j]);
        }
    }
}

/* ---- dot products: RT activation rows (xq, xb bytes apart) against one weight row ---- */

#if INT_SIMD
/* Each row's block sums in two int32 accumulators (a0: even steps, a1: odd), so that a single row still
 * has two independent chains of vpdpbusd; each weight chunk is loaded and unpacked once for all rows. */
static inline __attribute__((always_inline)) void int_tile(const int i8, const uint8_t *w, const uint8_t *ahead,
                                                           const uint8_t *xq, int64_t xb, int groups, const int RT,
                                                           float *y, int ys) {
    const int gb = i8 ? GROUP_I8 : GROUP_I4;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 f[INT_ROWS];
    for (int r = 0; r < RT; r++) f[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        const uint8_t *wg = w + (int64_t)g * gb, *xg = xq + (int64_t)g * GROUP_X;
        for (int line = 0; line < gb; line += 64) _mm_prefetch((const char *)ahead + (int64_t)g * gb + line, _MM_HINT_T0);
        __m256i a0[INT_ROWS], a1[INT_ROWS];
        for (int r = 0; r < RT; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        for (int c = 0; c < (i8 ? 8 : 4); c += i8 ? 2 : 1) {
            __m256i u0, u1;
            if (i8) {
                u0 = _mm256_loadu_si256((const __m256i *)(wg + 32 * c));
                u1 = _mm256_loadu_si256((const __m256i *)(wg + 32 * c + 32));
            } else {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(wg + 32 * c));
                u0 = _mm256_and_si256(v, low);
                u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            const int step = i8 ? 32 * c : 64 * c; /* activation bytes of the step u0 multiplies */
#if !VNNI /* maddubs would saturate on 8-bit u up to 255: |q| times a with q's sign (q = u - 128) */
            const __m256i q0 = _mm256_xor_si256(u0, _mm256_set1_epi8((char)0x80));
            const __m256i q1 = _mm256_xor_si256(u1, _mm256_set1_epi8((char)0x80));
            const __m256i p0 = i8 ? _mm256_abs_epi8(q0) : u0, p1 = i8 ? _mm256_abs_epi8(q1) : u1;
#endif
            for (int r = 0; r < RT; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xg + r * xb + step));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xg + r * xb + step + 32));
#if VNNI
                a0[r] = DPBUSD(a0[r], u0, x0);
                a1[r] = DPBUSD(a1[r], u1, x1);
#else
                if (i8) {
                    a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(p0, _mm256_sign_epi8(x0, q0)), ones));
                    a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(p1, _mm256_sign_epi8(x1, q1)), ones));
                } else { /* int16 sums: 4 steps of pairs <= 4 * 2 * 15 * 127 < 2^15 */
                    a0[r] = _mm256_add_epi16(a0[r], _mm256_maddubs_epi16(p0, x0));
                    a1[r] = _mm256_add_epi16(a1[r], _mm256_maddubs_epi16(p1, x1));
                }
#endif
            }
        }
        const __m256 dw = _mm256_loadu_ps((const float *)(wg + gb - 64)), m = _mm256_loadu_ps((const float *)(wg + gb - 32));
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = xg + r * xb;
            __m256i D;
#if VNNI
            D = _mm256_add_epi32(a0[r], a1[r]);
#else
            if (i8) /* sum (q + 128) a = sum q a + 128 sum a */
                D = _mm256_add_epi32(_mm256_add_epi32(a0[r], a1[r]),
                                     _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xr + 320)), 7));
            else
                D = _mm256_add_epi32(_mm256_madd_epi16(a0[r], ones), _mm256_madd_epi16(a1[r], ones));
#endif
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(D), _mm256_loadu_ps((const float *)(xr + 256)));
            f[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps((const float *)(xr + 288)), _mm256_fmadd_ps(t, dw, f[r]));
        }
    }
    for (int r = 0; r < RT; r++) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(f[r]), _mm256_extractf128_ps(f[r], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        y[r * ys] = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
    }
}
#else
static void int_tile(const int i8, const uint8_t *w, const uint8_t *ahead, const uint8_t *xq, int64_t xb, int groups,
                     const int RT, float *y, int ys) {
    const int gb = i8 ? GROUP_I8 : GROUP_I4;
    (void)ahead;
    for (int r = 0; r < RT; r++) {
        float f[8] = {0};
        for (int g = 0; g < groups; g++) {
            const uint8_t *wg = w + (int64_t)g * gb, *xg = xq + r * xb + (int64_t)g * GROUP_X;
            const float *dw = (const float *)(wg + gb - 64), *m = dw + 8, *da = (const float *)(xg + 256), *s = da + 8;
            for (int j = 0; j < 8; j++) {
                int32_t D = 0;
                for (int i = 0; i < 32; i++) {
                    const int a = (int8_t)xg[32 * (i / 4) + 4 * j + i % 4];
                    const int u = i8 ? wg[32 * (i / 4) + 4 * j + i % 4]
                                     : (wg[32 * (i / 8) + 4 * j + i % 4] >> (i % 8 >= 4 ? 4 : 0)) & 0x0f;
                    D += u * a;
                }
                f[j] = fmaf(m[j], s[j], fmaf((float)D * da[j], dw[j], f[j]));
            }
        }
        y[r * ys] = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7])); /* lane_sum's tree */
    }
}
#endif

/* y[r * ys + o] for rows r < rows of xq against the no weight rows at w; `ahead`: a row to prefetch. */
static void int8_rows(const int i8, const uint8_t *w, int64_t row_bytes, int no, const uint8_t *xq, int64_t xb,
                      int rows, int Kp, float *y, int ys) {
    const int groups = Kp / GROUP_IN;
    for (int r0 = 0; r0 < rows; r0 += INT_ROWS) {
        const int rt = rows - r0 < INT_ROWS ? rows - r0 : INT_ROWS;
        const uint8_t *xr = xq + r0 * xb;
        for (int o = 0; o < no; o++) {
            const uint8_t *wo = w + o * row_bytes, *ahead = wo + 4 * row_bytes;
            float *yo = y + r0 * ys + o;
            switch (rt) { /* each row count its own unrolled tile */
            case 1: int_tile(i8, wo, ahead, xr, xb, groups, 1, yo, ys); break;
            case 2: int_tile(i8, wo, ahead, xr, xb, groups, 2, yo, ys); break;
            case 3: int_tile(i8, wo, ahead, xr, xb, groups, 3, yo, ys); break;
#if INT_ROWS > 4
            case 4: int_tile(i8, wo, ahead, xr, xb, groups, 4, yo, ys); break;
            case 5: int_tile(i8, wo, ahead, xr, xb, groups, 5, yo, ys); break;
            case 6: int_tile(i8, wo, ahead, xr, xb, groups, 6, yo, ys); break;
            case 7: int_tile(i8, wo, ahead, xr, xb, groups, 7, yo, ys); break;
#endif
            default: int_tile(i8, wo, ahead, xr, xb, groups, INT_ROWS, yo, ys); break;
            }
        }
    }
}
#endif
