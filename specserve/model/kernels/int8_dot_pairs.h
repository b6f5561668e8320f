/* int8_dot.h's tiles on 512-bit vectors, where the CPU has AVX-512 VNNI: two weight rows at once, row o in
 * the low 256 bits and row o + 1 in the high, against each activation chunk broadcast to both halves.
 *
 * Why: with many rows the integer path is bound by vpdpbusd, and one zmm vpdpbusd does the work of two ymm
 * ones at a higher rate (bench/cpu_peak.py, one core: 92 vs 63.5 G multiply-adds/s on the Intel Xeon here,
 * 112 vs 95 on the AMD EPYC). The weight layout stays int8_dot.h's, and every lane computes the integers
 * and float32 steps of the ymm tile in the same order, each half summed by the same tree: the same bits
 * (tests/model/test_int8_dot.py compares the builds). Included by int8_dot.h inside its INT_SIMD part. */
#ifndef SPECSERVE_INT8_DOT_PAIRS_H
#define SPECSERVE_INT8_DOT_PAIRS_H

static inline __m512i pair_si(const uint8_t *lo, const uint8_t *hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)lo)),
                              _mm256_loadu_si256((const __m256i *)hi), 1);
}
static inline __m512 pair_ps(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}
/* 32 activation bytes (or 8 floats) in both halves. */
static inline __m512i both_si(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
static inline __m512 both_ps(const uint8_t *p) {
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p)));
}

/* The two halves' lane trees of f (int_tile's) into y[0] and y[1]. */
static inline void pair_sums(__m512 f, float *y) {
    y[0] = lane_tree(_mm512_castps512_ps256(f));
    y[1] = lane_tree(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)));
}

static inline void prefetch_pair(const uint8_t *ahead, int64_t row_bytes, int64_t offset, int bytes) {
    for (int line = 0; line < bytes; line += 64) {
        _mm_prefetch((const char *)ahead + offset + line, _MM_HINT_T0);
        _mm_prefetch((const char *)ahead + row_bytes + offset + line, _MM_HINT_T0);
    }
}

/* int_tile (4- and 8-bit kinds, VNNI) for weight rows w and w + row_bytes: y[r * ys] and y[r * ys + 1]. */
static inline __attribute__((always_inline)) void int_tile_pair(const int kind, const uint8_t *w, int64_t row_bytes,
                                                                const uint8_t *ahead, const uint8_t *xq, int64_t xb,
                                                                int Kp, const int RT, float *y, int ys) {
    const int gb = w_group_bytes(kind, 8), i8 = kind & 1;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 f[INT_ROWS];
    for (int r = 0; r < RT; r++) f[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups_of(Kp); g++) {
        const int S = group_steps(g, Kp);
        const uint8_t *wg = w + (int64_t)g * gb, *xg = xq + (int64_t)g * x_group_bytes(8);
        prefetch_pair(ahead, row_bytes, (int64_t)g * gb, w_group_bytes(kind, S));
        __m512i a0[INT_ROWS], a1[INT_ROWS];
        for (int r = 0; r < RT; r++) a0[r] = a1[r] = _mm512_setzero_si512();
        for (int c = 0; c < (i8 ? S : S / 2); c += i8 ? 2 : 1) {
            __m512i u0, u1;
            if (i8) {
                u0 = pair_si(wg + 32 * c, wg + row_bytes + 32 * c);
                u1 = pair_si(wg + 32 * c + 32, wg + row_bytes + 32 * c + 32);
            } else {
                const __m512i v = pair_si(wg + 32 * c, wg + row_bytes + 32 * c);
                u0 = _mm512_and_si512(v, low);
                u1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            const int step = i8 ? 32 * c : 64 * c;
            for (int r = 0; r < RT; r++) {
                a0[r] = _mm512_dpbusd_epi32(a0[r], u0, both_si(xg + r * xb + step));
                a1[r] = _mm512_dpbusd_epi32(a1[r], u1, both_si(xg + r * xb + step + 32));
            }
        }
        const uint8_t *s0 = wg + w_ints_bytes(kind, S), *s1 = s0 + row_bytes;
        __m512 dw, m;
        if (kind & 2) {
            dw = pair_ps(_mm256_loadu_ps((const float *)s0), _mm256_loadu_ps((const float *)s1));
            m = pair_ps(_mm256_loadu_ps((const float *)(s0 + 32)), _mm256_loadu_ps((const float *)(s1 + 32)));
        } else {
            dw = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)s0)),
                                                         _mm_loadu_si128((const __m128i *)s1), 1));
            m = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s0 + 16))),
                _mm_loadu_si128((const __m128i *)(s1 + 16)), 1));
        }
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = xg + r * xb + 32 * S; /* da[8], s[8], ... */
            const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(a0[r], a1[r])), both_ps(xr));
            f[r] = _mm512_fmadd_ps(m, both_ps(xr + 32), _mm512_fmadd_ps(t, dw, f[r]));
        }
    }
    for (int r = 0; r < RT; r++) pair_sums(f[r], y + r * ys);
}

/* i6_high on both halves. */
static inline __m512i i6_high_pair(__m512i h, const int c) {
    const __m512i top = _mm512_set1_epi8(0x30);
    if (c == 0) return _mm512_and_si512(_mm512_slli_epi16(h, 4), top);
    if (c == 1) return _mm512_and_si512(_mm512_slli_epi16(h, 2), top);
    if (c == 2) return _mm512_and_si512(h, top);
    return _mm512_and_si512(_mm512_srli_epi16(h, 2), top);
}

/* int6_tile (Q6_K, VNNI) for weight rows w and w + row_bytes. */
static inline __attribute__((always_inline)) void int6_tile_pair(const uint8_t *w, int64_t row_bytes,
                                                                 const uint8_t *ahead, const uint8_t *xq, int64_t xb,
                                                                 int Kp, const int RT, float *y, int ys) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 f[INT_ROWS];
    for (int r = 0; r < RT; r++) f[r] = _mm512_setzero_ps();
    for (int g = 0; g < Kp / GROUP_IN; g++) {
        const uint8_t *wg = w + (int64_t)g * I6_GROUP_BYTES, *xg = xq + (int64_t)g * x_group_bytes(8);
        prefetch_pair(ahead, row_bytes, (int64_t)g * I6_GROUP_BYTES, I6_GROUP_BYTES);
        __m512i a0[INT_ROWS], a1[INT_ROWS];
        for (int r = 0; r < RT; r++) a0[r] = a1[r] = _mm512_setzero_si512();
        const __m512i h0 = pair_si(wg + 128, wg + row_bytes + 128), h1 = pair_si(wg + 160, wg + row_bytes + 160);
        _Pragma("GCC unroll 4")
        for (int c = 0; c < 4; c++) {
            __m512i n0 = pair_si(wg + 32 * (c / 2), wg + row_bytes + 32 * (c / 2));
            __m512i n1 = pair_si(wg + 32 * (c / 2 + 2), wg + row_bytes + 32 * (c / 2 + 2));
            if (c % 2) {
                n0 = _mm512_srli_epi16(n0, 4);
                n1 = _mm512_srli_epi16(n1, 4);
            }
            const __m512i u0 = _mm512_or_si512(_mm512_and_si512(n0, low), i6_high_pair(h0, c));
            const __m512i u1 = _mm512_or_si512(_mm512_and_si512(n1, low), i6_high_pair(h1, c));
            for (int r = 0; r < RT; r++) {
                a0[r] = _mm512_dpbusd_epi32(a0[r], u0, both_si(xg + r * xb + 32 * c));
                a1[r] = _mm512_dpbusd_epi32(a1[r], u1, both_si(xg + r * xb + 32 * (c + 4)));
            }
        }
        const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
            _mm_loadl_epi64((const __m128i *)(wg + 192)), _mm_loadl_epi64((const __m128i *)(wg + row_bytes + 192))));
        const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
            _mm_loadl_epi64((const __m128i *)(wg + 200)), _mm_loadl_epi64((const __m128i *)(wg + row_bytes + 200))));
        const __m512 d = pair_ps(_mm256_set1_ps(*(const float *)(wg + 208)),
                                 _mm256_set1_ps(*(const float *)(wg + row_bytes + 208)));
        for (int r = 0; r < RT; r++) {
            const uint8_t *xr = xg + r * xb + 256; /* da[8], s[8], sum(a)[8], half(a)[8] */
            const __m512i sum = both_si(xr + 64), half = both_si(xr + 96);
            const __m512i A = _mm512_sub_epi32(a0[r], _mm512_slli_epi32(half, 5));
            const __m512i B = _mm512_sub_epi32(a1[r], _mm512_slli_epi32(_mm512_sub_epi32(sum, half), 5));
            const __m512i D = _mm512_add_epi32(_mm512_mullo_epi32(sc0, A), _mm512_mullo_epi32(sc1, B));
            f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(D), both_ps(xr)), d, f[r]);
        }
    }
    for (int r = 0; r < RT; r++) pair_sums(f[r], y + r * ys);
}

static inline __attribute__((always_inline)) void any_tile_pair(const int kind, const uint8_t *w, int64_t row_bytes,
                                                                const uint8_t *ahead, const uint8_t *xq, int64_t xb,
                                                                int Kp, const int RT, float *y, int ys) {
    if (kind == KIND_I6) int6_tile_pair(w, row_bytes, ahead, xq, xb, Kp, RT, y, ys);
    else int_tile_pair(kind, w, row_bytes, ahead, xq, xb, Kp, RT, y, ys);
}

#endif
