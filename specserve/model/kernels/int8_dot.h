/* Integer dot products for 4-, 6- and 8-bit weights (included by linear.c: FMT_I4, FMT_I8, FMT_I4_WIDE,
 * FMT_I6).
 *
 * Why: expanding weights to float32 costs more arithmetic per row than the multiply-adds themselves, so
 * 32 rows cost ~12x one row. Here each row of x is quantized once per call to int8 in blocks of 32
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
 * Layout, "lanes are blocks": a group is 8 consecutive blocks (256 inputs), and one 256-bit vector holds
 * 4 consecutive bytes of each of the 8 blocks, lane j for block j, so that the 8 steps of vpdpbusd leave
 * block j's D in lane j and the float32 step runs 8 blocks at a time: f = fma(float(D) * da, dw, f);
 * f = fma(m, s, f). The 8 lanes of f are summed at the end in one fixed tree:
 * ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)). The blocks past the last whole group form a tail
 * group of S = 2 or 4 blocks (1-2 or 3-4 blocks, padded with zero blocks; 5-7 make a whole group, S = 8)
 * whose lanes split blocks: L = 8 / S lanes per block, lane l holds part l % L (4 S bytes) of block l / L,
 * in S steps. (SmolLM2's 576 inputs: 2 whole groups and a tail of 2 blocks, no padding.)
 *   weight row, per group of S steps: the integers, then dw[8], m[8] (f16 where every value is exact in
 *     f16 (Q4_0, Q4_1, Q8_0: the file's own f16 scales), float32 for Q4_K ("wide"); m only in a block's
 *     first lane, 0 in the others, so that m s counts once). I4: S / 2 chunks of 32 bytes; byte 4l + i
 *     of chunk c holds lane l's weight of step 2c, byte i (low nibble) and of step 2c + 1 (high).
 *     I8: S chunks of 32 bytes; byte 4l + i of chunk t: lane l's weight of step t, byte i (u = q + 128).
 *   activation row, per group: S steps of 32 bytes (byte 4l + i of step t: lane l's a of step t, byte i),
 *     then da[8], s[8] (float32; s of the whole block in each of its lanes), sum(a)[8] and half(a)[8]
 *     (int32, over the lane's own bytes: all, and those of steps t < S / 2). Lane l's byte i of step t is
 *     byte 4 S (l % L) + 4 t + i of block l / L.
 *
 * Q6_K ("I6", kind KIND_I6) has a scale per 16 weights, so its block sum is two sums: with S = 8 (a Q6_K
 * row is whole super-blocks of 256, one group each), steps 0-3 of lane l are weights 0-15 of block l and
 * steps 4-7 weights 16-31. Its u = q in [0, 63] and w = d sc (u - 32), so the block's exact integer is
 * D = sc0 (A - 32 half) + sc1 (B - 32 (sum - half)), A and B the two halves' sums of u a (|D| < 2^24: exact
 * in float32), and f = fma(float(D) da, d, f), no offset term. Weight group: the low nibbles as I4's (4
 * chunks: byte 4l + i of chunk c holds step 2c's low nibble and step 2c + 1's high), the high 2 bits in
 * 2 chunks (byte 4l + i of chunk h, bits 2s: step 4h + s), sc0[8] and sc1[8] (int8), d (float32), padding:
 * 224 bytes a 256 weights (7 bits a weight; the file's Q6_K has 6.56). */
#ifndef SPECSERVE_INT8_DOT_H
#define SPECSERVE_INT8_DOT_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "gguf_block.h"

enum { GROUP_IN = 256, KIND_I6 = 3, I6_GROUP_BYTES = 224 };

/* Steps of group g of a row of Kp inputs (8, or the tail's 2 or 4), and bytes of a group of S steps. */
static inline int group_steps(int g, int Kp) { return g < Kp / GROUP_IN ? 8 : (Kp % GROUP_IN) / 32; }
static inline int groups_of(int Kp) { return (Kp + GROUP_IN - 1) / GROUP_IN; }
/* K inputs (a multiple of 32) -> Kp: the tail's 1-2 blocks padded to 2, 3-4 to 4, 5-7 to a whole group. */
static inline int int8_padded(int K) {
    const int tail = (K / 32) % 8;
    return K - 32 * tail + 32 * (tail == 0 ? 0 : tail <= 2 ? 2 : tail <= 4 ? 4 : 8);
}
/* kind: KIND_I6 (Q6_K, above); else bit 0 set for 8-bit weights (I8), bit 1 for float32 scales (wide), neither
 * for 4-bit weights with f16 scales. */
static inline int w_group_bytes(int kind, int S) {
    return kind == KIND_I6 ? I6_GROUP_BYTES : (kind & 1 ? 32 : 16) * S + (kind & 2 ? 64 : 32);
}
static inline int w_ints_bytes(int kind, int S) { return kind == KIND_I6 ? 24 * S : (kind & 1 ? 32 : 16) * S; }

/* Lane l's dw and m of a weight group whose scales start at p. */
static inline float scale_at(int kind, const uint8_t *p, int l) {
    return kind & 2 ? ((const float *)p)[l] : f16_to_f32(read_u16(p + 2 * l));
}
static inline int x_group_bytes(int S) { return 32 * S + 128; }
/* Bytes of a row of Kp inputs whose whole groups take `whole` bytes and whose tail group (if any) `tail`. */
static inline int64_t row_bytes(int Kp, int whole, int tail) {
    return (int64_t)(Kp / GROUP_IN) * whole + (Kp % GROUP_IN ? tail : 0);
}
static inline int64_t int8_w_bytes(int kind, int Kp) {
    return row_bytes(Kp, w_group_bytes(kind, 8), w_group_bytes(kind, (Kp % GROUP_IN) / 32));
}
/* Lane l's byte i of step t in a group of S steps: byte 4 S (l % L) + 4 t + i of the group's block l / L. */
static inline int lane_byte(int S, int l, int t, int i) {
    return 32 * (l / (8 / S)) + 4 * S * (l % (8 / S)) + 4 * t + i;
}

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
/* Two weight rows a tile on 512-bit vectors (int8_dot_pairs.h). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAIRS 1
#else
#define PAIRS 0
#endif
#else
#define PAIRS 0
#define INT_SIMD 0
#define INT_ROWS 4
#endif

static inline int64_t int8_x_bytes(int Kp) {
    return row_bytes(Kp, x_group_bytes(8), x_group_bytes((Kp % GROUP_IN) / 32));
}

/* ---- activations: one float32 row (Kp values, zero past K) -> its quantized row ---- */
static void int8_quantize_row(const float *x, int Kp, uint8_t *dst) {
    for (int g = 0; g < groups_of(Kp); g++) {
        const int S = group_steps(g, Kp), L = 8 / S;
        uint8_t *xg = dst + (int64_t)g * x_group_bytes(8);
        float *da = (float *)(xg + 32 * S), *s = da + 8;
        int32_t *sum = (int32_t *)(s + 8), *half = sum + 8;
        for (int j = 0; j < S; j++) { /* block j of the group */
            const float *xb = x + (int64_t)g * GROUP_IN + 32 * j;
            int8_t q[32];
            int32_t total = 0;
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
            const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
            const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(b, order));
#else
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
            for (int i = 0; i < 32; i++) q[i] = (int8_t)nearbyintf(xb[i] * id);
#endif
            for (int i = 0; i < 32; i++) total += q[i];
            for (int l = j * L; l < (j + 1) * L; l++) {
                da[l] = d;
                s[l] = d * (float)total;
                sum[l] = half[l] = 0;
                for (int t = 0; t < S; t++) {
                    const int8_t *a = q + lane_byte(S, l, t, 0) - 32 * j;
                    memcpy(xg + 32 * t + 4 * l, a, 4);
                    sum[l] += a[0] + a[1] + a[2] + a[3];
                    if (t < S / 2) half[l] = sum[l];
                }
            }
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

/* v as f16 bits, if v is exactly an f16 value; else returns 0. */
static inline int f16_exact(float v, uint16_t *h) {
    uint32_t u;
    memcpy(&u, &v, 4);
    const uint16_t sign = (uint16_t)(u >> 16 & 0x8000u);
    const int e = (int)(u >> 23 & 0xff) - 127;
    const float mag = fabsf(v);
    if (mag == 0.f) *h = sign;
    else if (e >= -14 && e <= 15) *h = sign | (uint16_t)((e + 15) << 10) | (uint16_t)((u & 0x7fffffu) >> 13);
    else if (e >= -24 && e < -14) *h = sign | (uint16_t)(mag * 16777216.f); /* subnormal: v / 2^-24 */
    else return 0;
    return f16_to_f32(*h) == v;
}

/* One Q6_K row of K inputs (a multiple of 256) -> I6 groups (the layout at the top). */
static void int6_pack_row(const uint8_t *row, int K, uint8_t *dst) {
    memset(dst, 0, (size_t)int8_w_bytes(KIND_I6, K));
    for (int g = 0; g < K / GROUP_IN; g++) {
        const uint8_t *p = row + 210 * g;
        uint8_t *wg = dst + (int64_t)g * I6_GROUP_BYTES;
        for (int l = 0; l < 8; l++) {
            uint8_t q[32];
            q6_k_block(p, l, q);
            for (int t = 0; t < 8; t++)
                for (int i = 0; i < 4; i++) {
                    wg[32 * (t / 2) + 4 * l + i] |= (uint8_t)((q[4 * t + i] & 0x0f) << (t % 2 ? 4 : 0));
                    wg[128 + 32 * (t / 4) + 4 * l + i] |= (uint8_t)((q[4 * t + i] >> 4) << (2 * (t % 4)));
                }
            wg[192 + l] = p[192 + 2 * l];
            wg[200 + l] = p[193 + 2 * l];
        }
        const float d = f16_to_f32(read_u16(p + 208));
        memcpy(wg + 208, &d, 4);
    }
}

/* Lane l's u of step t, byte i, in an I6 weight group. */
static inline int i6_int(const uint8_t *wg, int l, int t, int i) {
    return ((wg[32 * (t / 2) + 4 * l + i] >> (t % 2 ? 4 : 0)) & 0x0f)
           | ((wg[128 + 32 * (t / 4) + 4 * l + i] >> (2 * (t % 4))) & 0x03) << 4;
}

/* One GGUF row of K inputs -> a row of Kp inputs of this kind (I8 from Q8_0, wide from Q4_K, I6 from Q6_K),
 * zero blocks past K. Returns 0 if a scale does not fit the f16 layout (-8 d or -128 d out of f16's range). */
static int int8_pack_row(int fmt, int kind, const uint8_t *row, int K, int Kp, uint8_t *dst) {
    if (kind == KIND_I6) {
        int6_pack_row(row, K, dst);
        return 1;
    }
    const int i8 = kind & 1;
    memset(dst, 0, (size_t)int8_w_bytes(kind, Kp));
    for (int b = 0; b < K / 32; b++) {
        const int g = b / 8, S = group_steps(g, Kp), L = 8 / S, j = b % 8;
        uint8_t u[32], *wg = dst + (int64_t)g * w_group_bytes(kind, 8), *scales = wg + w_ints_bytes(kind, S);
        float scale, offset;
        gguf_block_ints(fmt, row, b, u, &scale, &offset);
        for (int l = j * L; l < (j + 1) * L; l++) {
            const float m = l == j * L ? offset : 0.f;
            if (kind & 2) {
                ((float *)scales)[l] = scale;
                ((float *)scales)[8 + l] = m;
            } else {
                uint16_t hd, hm;
                if (!f16_exact(scale, &hd) || !f16_exact(m, &hm)) return 0;
                memcpy(scales + 2 * l, &hd, 2);
                memcpy(scales + 16 + 2 * l, &hm, 2);
            }
            for (int i = 0; i < 4; i++)
                if (i8)
                    for (int t = 0; t < S; t++) wg[32 * t + 4 * l + i] = u[lane_byte(S, l, t, i) - 32 * j];
                else
                    for (int c = 0; c < S / 2; c++)
                        wg[32 * c + 4 * l + i] = (uint8_t)(u[lane_byte(S, l, 2 * c, i) - 32 * j]
                                                           | u[lane_byte(S, l, 2 * c + 1, i) - 32 * j] << 4);
        }
    }
    return 1;
}

/* Lane l's integer of step t, byte i, in weight group wg of S steps. */
static inline int w_int(int kind, const uint8_t *wg, int l, int t, int i) {
    return kind & 1 ? wg[32 * t + 4 * l + i] : (wg[32 * (t / 2) + 4 * l + i] >> (t % 2 ? 4 : 0)) & 0x0f;
}

/* The float32 values dw u + m of a row's first K inputs (equal to the GGUF block's own). */
static void int8_dequantize_row(int kind, const uint8_t *row, int K, float *dst) {
    if (kind == KIND_I6) { /* (d sc) (u - 32), as gguf-py computes it */
        for (int g = 0; g < K / GROUP_IN; g++) {
            const uint8_t *wg = row + (int64_t)g * I6_GROUP_BYTES;
            float d;
            memcpy(&d, wg + 208, 4);
            for (int l = 0; l < 8; l++)
                for (int t = 0; t < 8; t++)
                    for (int i = 0; i < 4; i++)
                        dst[GROUP_IN * g + 32 * l + 4 * t + i] =
                            d * (float)(int8_t)wg[192 + 8 * (t / 4) + l] * (float)(i6_int(wg, l, t, i) - 32);
        }
        return;
    }
    const int Kp = int8_padded(K);
    for (int b = 0; b < K / 32; b++) {
        const int g = b / 8, S = group_steps(g, Kp), L = 8 / S, j = b % 8;
        const uint8_t *wg = row + (int64_t)g * w_group_bytes(kind, 8), *scales = wg + w_ints_bytes(kind, S);
        const float m = scale_at(kind, scales + (kind & 2 ? 32 : 16), j * L);
        for (int l = j * L; l < (j + 1) * L; l++)
            for (int t = 0; t < S; t++)
                for (int i = 0; i < 4; i++)
                    dst[32 * g * 8 + lane_byte(S, l, t, i)] =
                        fmaf(scale_at(kind, scales, l), (float)w_int(kind, wg, l, t, i), m);
    }
}

/* ---- dot products: RT activation rows (xq, xb bytes apart) against one weight row ---- */

#if INT_SIMD
/* The 8 lanes of f summed in the fixed tree ((f0 + f4) + (f2 + f6)) + ((f1 + f5) + (f3 + f7)). */
static inline float lane_tree(__m256 f) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

/* Each row's block sums in two int32 accumulators (a0: even steps, a1: odd), so that a single row still
 * has two independent chains of vpdpbusd; each weight chunk is loaded and unpacked once for all rows. */
static inline __attribute__((always_inline)) void int_tile(const int kind, const uint8_t *w, const uint8_t *ahead,
                                                           const uint8_t *xq, int64_t xb, int Kp, const int RT,
                                                           float *y, int ys) {
    const int gb = w_group_bytes(kind, 8), i8 = kind & 1;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 f[INT_ROWS];
    for (int r = 0; r < RT; r++) f[r] = _mm256_setzero_ps();
    for (int g = 0; g < groups_of(Kp); g++) {
        const int S = group_steps(g, Kp);
        const uint8_t *wg = w + (int64_t)g * gb, *xg = xq + (int64_t)g * x_group_bytes(8);
        for (int line = 0; line < w_group_bytes(kind, S); line += 64)
            _mm_prefetch((const char *)ahead + (int64_t)g * gb + line, _MM_HINT_T0);
        __m256i a0[INT_ROWS], a1[INT_ROWS];
        for (int r = 0; r < RT; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        for (int c = 0; c < (i8 ? S : S / 2); c += i8 ? 2 : 1) {
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
                    const __m256i s0 = _mm256_maddubs_epi16(p0, _mm256_sign_epi8(x0, q0));
                    const __m256i s1 = _mm256_maddubs_epi16(p1, _mm256_sign_epi8(x1, q1));
                    a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(s0, ones));
                    a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(s1, ones));
                } else { /* int16 sums: 4 steps of pairs <= 4 * 2 * 15 * 127 < 2^15 */
                    a0[r] = _mm256_add_epi16(a0[r], _mm256_maddubs_epi16(p0, x0));
                    a1[r] = _mm256_add_epi16(a1[r], _mm256_maddubs_epi16(p1, x1));
                }
#endif
            }
        }
        const uint8_t *scales = wg + w_ints_bytes(kind, S);
        const __m256 dw = kind & 2 ? _mm256_loadu_ps((const float *)scales)
                                   : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)scales));
        const __m256 m = kind & 2 ? _mm256_loadu_ps((const float *)(scales + 32))
                                  : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + 16)));
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = xg + r * xb + 32 * S; /* da[8], s[8], sum(a)[8] */
            __m256i D;
#if VNNI
            D = _mm256_add_epi32(a0[r], a1[r]);
#else
            if (i8) /* sum (q + 128) a = sum q a + 128 sum a */
                D = _mm256_add_epi32(_mm256_add_epi32(a0[r], a1[r]),
                                     _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(xr + 64)), 7));
            else
                D = _mm256_add_epi32(_mm256_madd_epi16(a0[r], ones), _mm256_madd_epi16(a1[r], ones));
#endif
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(D), _mm256_loadu_ps((const float *)xr));
            f[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps((const float *)(xr + 32)), _mm256_fmadd_ps(t, dw, f[r]));
        }
    }
    for (int r = 0; r < RT; r++) y[r * ys] = lane_tree(f[r]);
}
/* Lane bytes' high 2 bits of step 4 h + c (c < 4) moved to bits 4-5: h holds them at bits 2c. */
static inline __m256i i6_high(__m256i h, const int c) {
    const __m256i top = _mm256_set1_epi8(0x30);
    if (c == 0) return _mm256_and_si256(_mm256_slli_epi16(h, 4), top);
    if (c == 1) return _mm256_and_si256(_mm256_slli_epi16(h, 2), top);
    if (c == 2) return _mm256_and_si256(h, top);
    return _mm256_and_si256(_mm256_srli_epi16(h, 2), top);
}

/* int_tile for I6 (Q6_K): a0 sums steps 0-3 (each block's first 16 weights), a1 steps 4-7, so that each
 * half gets its own scale; steps c and c + 4 go together. */
static inline __attribute__((always_inline)) void int6_tile(const uint8_t *w, const uint8_t *ahead, const uint8_t *xq,
                                                            int64_t xb, int Kp, const int RT, float *y, int ys) {
    const __m256i low = _mm256_set1_epi8(0x0f);
#if !VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    __m256 f[INT_ROWS];
    for (int r = 0; r < RT; r++) f[r] = _mm256_setzero_ps();
    for (int g = 0; g < Kp / GROUP_IN; g++) {
        const uint8_t *wg = w + (int64_t)g * I6_GROUP_BYTES, *xg = xq + (int64_t)g * x_group_bytes(8);
        for (int line = 0; line < I6_GROUP_BYTES; line += 64)
            _mm_prefetch((const char *)ahead + (int64_t)g * I6_GROUP_BYTES + line, _MM_HINT_T0);
        __m256i a0[INT_ROWS], a1[INT_ROWS];
        for (int r = 0; r < RT; r++) a0[r] = a1[r] = _mm256_setzero_si256();
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(wg + 128));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(wg + 160));
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            __m256i n0 = _mm256_loadu_si256((const __m256i *)(wg + 32 * (c / 2)));
            __m256i n1 = _mm256_loadu_si256((const __m256i *)(wg + 32 * (c / 2 + 2)));
            if (c % 2) {
                n0 = _mm256_srli_epi16(n0, 4);
                n1 = _mm256_srli_epi16(n1, 4);
            }
            const __m256i u0 = _mm256_or_si256(_mm256_and_si256(n0, low), i6_high(h0, c));
            const __m256i u1 = _mm256_or_si256(_mm256_and_si256(n1, low), i6_high(h1, c));
            for (int r = 0; r < RT; r++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xg + r * xb + 32 * c));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xg + r * xb + 32 * (c + 4)));
#if VNNI
                a0[r] = DPBUSD(a0[r], u0, x0);
                a1[r] = DPBUSD(a1[r], u1, x1);
#else /* u <= 63: pairs of maddubs stay below 2^15, but 4 steps of them would not: to int32 each step */
                a0[r] = _mm256_add_epi32(a0[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u0, x0), ones));
                a1[r] = _mm256_add_epi32(a1[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u1, x1), ones));
#endif
            }
        }
        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + 192)));
        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(wg + 200)));
        const __m256 d = _mm256_set1_ps(*(const float *)(wg + 208));
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = xg + r * xb + 256; /* da[8], s[8], sum(a)[8], half(a)[8] */
            const __m256i sum = _mm256_loadu_si256((const __m256i *)(xr + 64));
            const __m256i half = _mm256_loadu_si256((const __m256i *)(xr + 96));
            const __m256i A = _mm256_sub_epi32(a0[r], _mm256_slli_epi32(half, 5));
            const __m256i B = _mm256_sub_epi32(a1[r], _mm256_slli_epi32(_mm256_sub_epi32(sum, half), 5));
            const __m256i D = _mm256_add_epi32(_mm256_mullo_epi32(sc0, A), _mm256_mullo_epi32(sc1, B));
            f[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(D), _mm256_loadu_ps((const float *)xr)), d, f[r]);
        }
    }
    for (int r = 0; r < RT; r++) y[r * ys] = lane_tree(f[r]);
}
#else
static void int_tile(const int kind, const uint8_t *w, const uint8_t *ahead, const uint8_t *xq, int64_t xb, int Kp,
                     const int RT, float *y, int ys) {
    (void)ahead;
    for (int r = 0; r < RT; r++) {
        float f[8] = {0};
        for (int g = 0; g < groups_of(Kp); g++) {
            const int S = group_steps(g, Kp);
            const uint8_t *wg = w + (int64_t)g * w_group_bytes(kind, 8);
            const uint8_t *xg = xq + r * xb + (int64_t)g * x_group_bytes(8);
            const uint8_t *scales = wg + w_ints_bytes(kind, S), *ms = scales + (kind & 2 ? 32 : 16);
            const float *da = (const float *)(xg + 32 * S), *s = da + 8;
            for (int l = 0; l < 8; l++) {
                int32_t D = 0;
                for (int t = 0; t < S; t++)
                    for (int i = 0; i < 4; i++) D += w_int(kind, wg, l, t, i) * (int8_t)xg[32 * t + 4 * l + i];
                f[l] = fmaf(scale_at(kind, ms, l), s[l], fmaf((float)D * da[l], scale_at(kind, scales, l), f[l]));
            }
        }
        y[r * ys] = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7])); /* the SIMD tree */
    }
}
static void int6_tile(const uint8_t *w, const uint8_t *ahead, const uint8_t *xq, int64_t xb, int Kp, const int RT,
                      float *y, int ys) {
    (void)ahead;
    for (int r = 0; r < RT; r++) {
        float f[8] = {0};
        for (int g = 0; g < Kp / GROUP_IN; g++) {
            const uint8_t *wg = w + (int64_t)g * I6_GROUP_BYTES, *xg = xq + r * xb + (int64_t)g * x_group_bytes(8);
            const float *da = (const float *)(xg + 256), d = *(const float *)(wg + 208);
            for (int l = 0; l < 8; l++) {
                int32_t D = 0;
                for (int t = 0; t < 8; t++) {
                    int32_t part = 0;
                    for (int i = 0; i < 4; i++) part += (i6_int(wg, l, t, i) - 32) * (int8_t)xg[32 * t + 4 * l + i];
                    D += (int8_t)wg[192 + 8 * (t / 4) + l] * part;
                }
                f[l] = fmaf((float)D * da[l], d, f[l]);
            }
        }
        y[r * ys] = ((f[0] + f[4]) + (f[2] + f[6])) + ((f[1] + f[5]) + (f[3] + f[7])); /* the SIMD tree */
    }
}
#endif

#if PAIRS
#include "int8_dot_pairs.h"
#endif

/* One tile of either layout. */
static inline __attribute__((always_inline)) void any_tile(const int kind, const uint8_t *w, const uint8_t *ahead,
                                                           const uint8_t *xq, int64_t xb, int Kp, const int RT,
                                                           float *y, int ys) {
    if (kind == KIND_I6) int6_tile(w, ahead, xq, xb, Kp, RT, y, ys);
    else int_tile(kind, w, ahead, xq, xb, Kp, RT, y, ys);
}

/* Each row count its own unrolled tile. */
#if INT_ROWS > 4
#define BY_ROWS(TILE)                                                                                          \
    switch (rt) {                                                                                              \
    case 1: TILE(1); break; case 2: TILE(2); break; case 3: TILE(3); break; case 4: TILE(4); break;           \
    case 5: TILE(5); break; case 6: TILE(6); break; case 7: TILE(7); break; default: TILE(INT_ROWS); break;  \
    }
#else
#define BY_ROWS(TILE)                                                                                          \
    switch (rt) {                                                                                              \
    case 1: TILE(1); break; case 2: TILE(2); break; case 3: TILE(3); break; default: TILE(INT_ROWS); break;  \
    }
#endif
#define ONE_TILE(RT) any_tile(kind, wo, ahead, xr, xb, Kp, RT, yo, ys)

/* y[r * ys + o] for rows r < rows of xq against the no weight rows at w (two at a time with PAIRS, for whole
 * tiles of INT_ROWS rows: the same bits either way). */
static inline __attribute__((always_inline)) void int8_rows_kind(const int kind, const uint8_t *w, int64_t row_bytes,
                                                                 int no, const uint8_t *xq, int64_t xb, int rows,
                                                                 int Kp, float *y, int ys) {
    for (int r0 = 0; r0 < rows; r0 += INT_ROWS) {
        const int rt = rows - r0 < INT_ROWS ? rows - r0 : INT_ROWS;
        const uint8_t *xr = xq + r0 * xb;
        for (int o = 0; o < no; o++) {
            const uint8_t *wo = w + o * row_bytes, *ahead = wo + 4 * row_bytes; /* the next group's row o */
            float *yo = y + r0 * ys + o;
#if PAIRS
            if (rt == INT_ROWS && o + 1 < no) { /* fewer rows ran faster on ymm (1 row: 6.6 vs 8.3 ms a decode) */
                any_tile_pair(kind, wo, row_bytes, ahead, xr, xb, Kp, INT_ROWS, yo, ys);
                o++;
                continue;
            }
#endif
            BY_ROWS(ONE_TILE);
        }
    }
}

/* int8_rows_kind with the kind a constant in each copy (no run-time branches on it in the tiles). */
static void int8_rows(const int kind, const uint8_t *w, int64_t row_bytes, int no, const uint8_t *xq, int64_t xb,
                      int rows, int Kp, float *y, int ys) {
    switch (kind) {
    case 0: int8_rows_kind(0, w, row_bytes, no, xq, xb, rows, Kp, y, ys); break;
    case 1: int8_rows_kind(1, w, row_bytes, no, xq, xb, rows, Kp, y, ys); break;
    case 2: int8_rows_kind(2, w, row_bytes, no, xq, xb, rows, Kp, y, ys); break;
    default: int8_rows_kind(KIND_I6, w, row_bytes, no, xq, xb, rows, Kp, y, ys); break;
    }
}
#endif
