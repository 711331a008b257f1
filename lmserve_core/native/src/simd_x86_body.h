/*
 * The x86 float kernels, written once over a float vector layer (vecf_avx2.h,
 * vecf_avx512.h) and compiled once per ISA that includes this file after its layer:
 * simd_avx2.c and simd_avx512.c, which add the kernels only their ISA has.
 *
 * Every 32-element group decodes into X_NW = 32 / LANES vectors. Decoding with fused = 0
 * runs the portable decoder's float operations, bit for bit (dequantization, the GEMM
 * panels); fused = 1 folds "q * d + m" into one FMA (dot products: one op and one rounding
 * fewer). A dot product takes each group one of two ways (X_GROUP_FACTOR, the layer's
 * choice): as the group's integers (or decoded values) summed against x in one product
 * chain and then multiplied by the group's factor once (the scale-only encodings skip a
 * multiply per weight; decode is bound by those instructions on AVX2), or as fused decoded
 * weights, each vector into its own accumulator. The layer's other constants set the rest
 * of what differs: how the f32 helpers' tails run (X_MASKED_TAILS), the GEMM tile's tokens
 * (X_GEMM_NR), the queries and dimensions of an attention pass (X_QK_QUERIES, X_PV_WIDE)
 * and exp's clamp (X_EXP_MAX).
 *
 * The attention kernels of several queries read each K / V row once for all of them; a
 * head size they do not cover, and the keys after the blocks of four, go through the AVX2
 * row kernels (simd_avx2.c, defined before this file is included), so that every ISA gives
 * the AVX2 bits.
 *
 * Defines XN(kernels_body)(lm_kernels *), installing what it defines, and for the ISA files'
 * own integer products the X_NT_SWITCH dispatch and the DEF_DOTQ32 driver (those files
 * undefine them).
 */

#define X_NW (32 / LANES) /* vectors of a 32-element group */

/* nt (1..8) onto fn compiled for each count, its last argument */
#define X_NT_SWITCH(nt, fn, ...)                                                                   \
    switch (nt) {                                                                                  \
    case 1: fn(__VA_ARGS__, 1); break;                                                             \
    case 2: fn(__VA_ARGS__, 2); break;                                                             \
    case 3: fn(__VA_ARGS__, 3); break;                                                             \
    case 4: fn(__VA_ARGS__, 4); break;                                                             \
    case 5: fn(__VA_ARGS__, 5); break;                                                             \
    case 6: fn(__VA_ARGS__, 6); break;                                                             \
    case 7: fn(__VA_ARGS__, 7); break;                                                             \
    default: fn(__VA_ARGS__, 8); break;                                                            \
    }

/* ------------------------------------------------------------------ 32-element groups
 * XN(dec_<type>)(b, g, s, w, fused) decodes group g into w[0 .. X_NW); s holds the block's
 * scales from XN(scales_<type>). */
#define AFFINE(q, d, m, fused)                                                                     \
    ((fused) ? XN(fmadd)((q), (d), (m)) : XN(add)(XN(mul)((q), (d)), (m)))
#define AFFINE_SUB(q, d, m, fused)                                                                 \
    ((fused) ? XN(fmsub)((q), (d), (m)) : XN(sub)(XN(mul)((d), (q)), (m)))

XF void XN(scale_group)(VECF w[X_NW], float s) {
    const VECF d = XN(set1)(s);
    for (int i = 0; i < X_NW; i++) w[i] = XN(mul)(w[i], d);
}

/* Scale-only encodings (Q4_0, Q5_0, Q8_0, Q2_0): XN(raw_<type>) gives the block's integers as
 * floats; the decoded weights are those times the block scale. */
XF void XN(raw_q4_0)(const block_q4_0 *b, VECF w[X_NW]) {
    const __m128i m4 = _mm_set1_epi8(0x0F), off = _mm_set1_epi8(8);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    XN(i8x16)(_mm_sub_epi8(_mm_and_si128(q, m4), off), w);
    XN(i8x16)(_mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), off), w + X_NW / 2);
}

/* fused: w * d + m, the offset (-8 d, -16 d) from lm_scales_<type> in s[1] */
XF void XN(fma_group)(VECF w[X_NW], const float *s) {
    const VECF d = XN(set1)(s[0]), m = XN(set1)(s[1]);
    for (int i = 0; i < X_NW; i++) w[i] = XN(fmadd)(w[i], d, m);
}

XF void XN(dec_q4_0)(const block_q4_0 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)g;
    if (fused) {
        const __m128i m4 = _mm_set1_epi8(0x0F);
        const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
        XN(u8x16)(_mm_and_si128(q, m4), w);
        XN(u8x16)(_mm_and_si128(_mm_srli_epi16(q, 4), m4), w + X_NW / 2);
        XN(fma_group)(w, s);
    } else {
        XN(raw_q4_0)(b, w);
        XN(scale_group)(w, s[0]);
    }
}

XF void XN(dec_q4_1)(const block_q4_1 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)g;
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs);
    const VECF d = XN(set1)(s[0]), m = XN(set1)(s[1]);
    XN(u8x16)(_mm_and_si128(q, m4), w);
    XN(u8x16)(_mm_and_si128(_mm_srli_epi16(q, 4), m4), w + X_NW / 2);
    for (int i = 0; i < X_NW; i++) w[i] = AFFINE(w[i], d, m, fused);
}

XF void XN(raw_q5_0)(const block_q5_0 *b, VECF w[X_NW]) {
    XN(q5_ps)(b->qs, b->qh, 16, w);
}

XF void XN(dec_q5_0)(const block_q5_0 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)g;
    XN(q5_ps)(b->qs, b->qh, fused ? 0 : 16, w);
    if (fused) {
        XN(fma_group)(w, s);
    } else {
        XN(scale_group)(w, s[0]);
    }
}

XF void XN(dec_q5_1)(const block_q5_1 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)g;
    const VECF d = XN(set1)(s[0]), m = XN(set1)(s[1]);
    XN(q5_ps)(b->qs, b->qh, 0, w);
    for (int i = 0; i < X_NW; i++) w[i] = AFFINE(w[i], d, m, fused);
}

XF void XN(raw_q8_0)(const block_q8_0 *b, VECF w[X_NW]) {
    for (int i = 0; i < X_NW; i++) w[i] = XN(i8_load)(b->qs + LANES * i);
}

XF void XN(dec_q8_0)(const block_q8_0 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)g;
    (void)fused;
    XN(raw_q8_0)(b, w);
    XN(scale_group)(w, s[0]);
}

/* Group g (0..7) of a Q4_K/Q5_K super-block: bytes qs[32 (g/2) ..], nibble g%2, scale g. */
XF __m256i XN(nibbles)(const uint8_t *p, int g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)p);
    return _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (g & 1))),
                            _mm256_set1_epi8(0x0F));
}

XF void XN(kq_affine)(__m256i q, const float *s, int g, VECF w[X_NW], int fused) {
    const VECF ds = XN(set1)(s[g]), ms = XN(set1)(s[8 + g]);
    XN(u8x16)(XN(lo128)(q), w);
    XN(u8x16)(XN(hi128)(q), w + X_NW / 2);
    for (int i = 0; i < X_NW; i++) w[i] = AFFINE_SUB(w[i], ds, ms, fused);
}

XF void XN(dec_q4_K)(const block_q4_K *b, int g, const float *s, VECF w[X_NW], int fused) {
    XN(kq_affine)(XN(nibbles)(b->qs + 32 * (g / 2), g), s, g, w, fused);
}

XF void XN(dec_q5_K)(const block_q5_K *b, int g, const float *s, VECF w[X_NW], int fused) {
    const __m256i qh = _mm256_loadu_si256((const __m256i *)b->qh);
    const __m256i h = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(g)),
                                       _mm256_set1_epi8(1));
    const __m256i q =
        _mm256_or_si256(XN(nibbles)(b->qs + 32 * (g / 2), g), _mm256_slli_epi16(h, 4));
    XN(kq_affine)(q, s, g, w, fused);
}

/* Group g (0..7): half n = g/4, then gg = g%4 picks the ql half (gg&1), the nibble (gg>>1)
 * and the 2-bit field 2*gg of qh; sixteen elements per scale. */
XF __m256i XN(q6_bytes)(const block_q6_K *b, int g) { /* signed, -32..31 */
    const int n = g / 4, gg = g % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * n + 32 * (gg & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * n));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(4 * (gg >> 1))),
                                        _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * gg)),
                                        _mm256_set1_epi8(3));
    return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
}

XF void XN(dec_q6_K)(const block_q6_K *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)fused;
    const int n = g / 4, gg = g % 4;
    const __m256i q = XN(q6_bytes)(b, g);
    const float *sc = s + 8 * n + 2 * gg;
    const VECF d0 = XN(set1)(sc[0]), d1 = XN(set1)(sc[1]);
    XN(i8x16)(XN(lo128)(q), w);
    XN(i8x16)(XN(hi128)(q), w + X_NW / 2);
    for (int i = 0; i < X_NW; i++) w[i] = XN(mul)(i < X_NW / 2 ? d0 : d1, w[i]);
}

/* Q2_0 / Q2_0_128: the 32 codes of a group (the 8 bytes at p), element i in byte i of lo
 * (i < 16) or of hi (i - 16): the four 2-bit fields of every byte split apart, then
 * interleaved back into element order (byte k holds elements 4k .. 4k + 3). */
XF void XN(q2_codes)(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i v = _mm_loadl_epi64((const __m128i *)p), m3 = _mm_set1_epi8(3);
    const __m128i c0 = _mm_and_si128(v, m3);
    const __m128i c1 = _mm_and_si128(_mm_srli_epi16(v, 2), m3);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), m3);
    const __m128i c3 = _mm_and_si128(_mm_srli_epi16(v, 6), m3);
    const __m128i a = _mm_unpacklo_epi8(c0, c1), b = _mm_unpacklo_epi8(c2, c3);
    *lo = _mm_unpacklo_epi16(a, b);
    *hi = _mm_unpackhi_epi16(a, b);
}

/* the group's signed integers, code - 1 (-1 .. 2) */
XF void XN(q2_ints8)(const uint8_t *p, __m128i *lo, __m128i *hi) {
    const __m128i one = _mm_set1_epi8(1);
    XN(q2_codes)(p, lo, hi);
    *lo = _mm_sub_epi8(*lo, one);
    *hi = _mm_sub_epi8(*hi, one);
}

XF void XN(raw_q2)(const uint8_t *p, VECF w[X_NW]) {
    __m128i lo, hi;
    XN(q2_ints8)(p, &lo, &hi);
    XN(i8x16)(lo, w);
    XN(i8x16)(hi, w + X_NW / 2);
}

/* exact, so fused or not gives the portable decoder's bits */
XF void XN(dec_q2_0)(const block_q2_0 *b, int g, const float *s, VECF w[X_NW], int fused) {
    (void)fused;
    XN(raw_q2)(b->qs + 8 * g, w);
    XN(scale_group)(w, s[0]);
}

XF void XN(dec_q2_0_128)(const block_q2_0_128 *b, int g, const float *s, VECF w[X_NW],
                         int fused) {
    (void)fused;
    XN(raw_q2)(b->qs + 8 * g, w);
    XN(scale_group)(w, s[0]);
}

/* K-quant scales: unpack, then widen and scale all sixteen at once. */
XF void XN(scales_q4_K)(const block_q4_K *b, float *s) {
    uint8_t u[16];
    lm_kq_unpack(b->scales, u);
    XN(scales_kq)(u, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

XF void XN(scales_q5_K)(const block_q5_K *b, float *s) {
    uint8_t u[16];
    lm_kq_unpack(b->scales, u);
    XN(scales_kq)(u, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

XF void XN(scales_q6_K)(const block_q6_K *b, float *s) {
    VECF f[16 / LANES];
    XN(i8x16)(_mm_loadu_si128((const __m128i *)b->scales), f);
    const VECF d = XN(set1)(lm_f16(&b->d));
    for (int i = 0; i < 16 / LANES; i++) XN(storeu)(s + LANES * i, XN(mul)(d, f[i]));
}

/* the other encodings' scales are scalar (lm_scales_<type>) */
#define DEF_SCALES(name, blk)                                                                      \
    XF void XN(scales_##name)(const blk *b, float *s) {                                            \
        lm_scales_##name(b, s);                                                                    \
    }
DEF_SCALES(q4_0, block_q4_0)
DEF_SCALES(q4_1, block_q4_1)
DEF_SCALES(q5_0, block_q5_0)
DEF_SCALES(q5_1, block_q5_1)
DEF_SCALES(q8_0, block_q8_0)
DEF_SCALES(q2_0, block_q2_0)
DEF_SCALES(q2_0_128, block_q2_0_128)
#undef DEF_SCALES

/* ------------------------------------------------------------------ dot products
 * XN(grp_w_<type>)(b, g, s, w): group g's weights for a dot product into w, returning the
 * factor they still need; XN(grp_fma)(w, f, x, acc) adds their products with x (32 values)
 * times f (the factor, broadcast) into X_ACCS accumulators. */
#define X_GRP_DECODED(name, type, blk, qk)                                                         \
    XF float XN(grp_w_##name)(const blk *b, int g, const float *s, VECF w[X_NW]) {                 \
        XN(dec_##name)(b, g, s, w, 1);                                                             \
        return 1.0f;                                                                               \
    }
#if X_GROUP_FACTOR
/* The scale-only encodings hand over their integers and the block scale (the dot product
 * multiplies by it once per group); the others are decoded to their values (factor 1, and
 * an FMA by 1 adds exactly). One accumulator per group: its product chain. */
#define X_ACCS 1
#define DEF_GRP_RAW(name, blk, raw)                                                                \
    XF float XN(grp_w_##name)(const blk *b, int g, const float *s, VECF w[X_NW]) {                 \
        (void)g;                                                                                   \
        raw;                                                                                       \
        return s[0];                                                                               \
    }
DEF_GRP_RAW(q4_0, block_q4_0, XN(raw_q4_0)(b, w))
DEF_GRP_RAW(q5_0, block_q5_0, XN(raw_q5_0)(b, w))
DEF_GRP_RAW(q8_0, block_q8_0, XN(raw_q8_0)(b, w))
DEF_GRP_RAW(q2_0, block_q2_0, XN(raw_q2)(b->qs + 8 * g, w))
DEF_GRP_RAW(q2_0_128, block_q2_0_128, XN(raw_q2)(b->qs + 8 * g, w))
#undef DEF_GRP_RAW
X_GRP_DECODED(q4_1, LM_Q4_1, block_q4_1, QK)
X_GRP_DECODED(q5_1, LM_Q5_1, block_q5_1, QK)
X_GRP_DECODED(q4_K, LM_Q4_K, block_q4_K, QKK)
X_GRP_DECODED(q5_K, LM_Q5_K, block_q5_K, QKK)
X_GRP_DECODED(q6_K, LM_Q6_K, block_q6_K, QKK)

XF void XN(grp_fma)(const VECF w[X_NW], VECF f, const float *x, VECF acc[X_ACCS]) {
    VECF p = XN(mul)(w[0], XN(loadu)(x));
    for (int v = 1; v < X_NW; v++) p = XN(fmadd)(w[v], XN(loadu)(x + LANES * v), p);
    acc[0] = XN(fmadd)(f, p, acc[0]);
}
#else
/* Every encoding decoded with its scale and offset fused (the factor is 1): a vector per
 * accumulator. */
#define X_ACCS X_NW
LM_BLOCK_TYPES(X_GRP_DECODED)

XF void XN(grp_fma)(const VECF w[X_NW], VECF f, const float *x, VECF acc[X_ACCS]) {
    (void)f;
    for (int v = 0; v < X_NW; v++) acc[v] = XN(fmadd)(w[v], XN(loadu)(x + LANES * v), acc[v]);
}
#endif
#undef X_GRP_DECODED

/* a group's accumulators summed */
XF VECF XN(fold)(const VECF acc[X_ACCS]) {
    VECF s = acc[0];
    for (int i = 1; i < X_ACCS; i++) s = XN(add)(s, acc[i]);
    return s;
}

/* dot and dequantize over whole blocks of `qk` elements made of qk/32 groups; the dot
 * keeps two groups in flight (each its X_ACCS accumulators) to hide the FMA latency */
#define DEF_BLOCK_KERNELS(name, blk, qk)                                                           \
    XF void XN(grp_acc_##name)(const blk *b, int g, const float *s, const float *x,                \
                               VECF acc[X_ACCS]) {                                                 \
        VECF w[X_NW];                                                                              \
        const float f = XN(grp_w_##name)(b, g, s, w);                                              \
        XN(grp_fma)(w, XN(set1)(f), x + 32 * g, acc);                                              \
    }                                                                                              \
    XFN float XN(dot_##name)(const void *row, const float *x, int64_t n) {                         \
        const blk *b = row;                                                                        \
        const int64_t nb = n / (qk);                                                               \
        VECF a0[X_ACCS], a1[X_ACCS];                                                               \
        for (int v = 0; v < X_ACCS; v++) a0[v] = a1[v] = XN(zero)();                               \
        float s[16], s1[16];                                                                       \
        if ((qk) / 32 >= 2) {                                                                      \
            for (int64_t i = 0; i < nb; i++) {                                                     \
                XN(scales_##name)(b + i, s);                                                       \
                for (int g = 0; g < (qk) / 32; g += 2) {                                           \
                    XN(grp_acc_##name)(b + i, g, s, x + i * (qk), a0);                             \
                    XN(grp_acc_##name)(b + i, g + 1, s, x + i * (qk), a1);                         \
                }                                                                                  \
            }                                                                                      \
        } else {                                                                                   \
            int64_t i = 0;                                                                         \
            for (; i + 2 <= nb; i += 2) {                                                          \
                XN(scales_##name)(b + i, s);                                                       \
                XN(scales_##name)(b + i + 1, s1);                                                  \
                XN(grp_acc_##name)(b + i, 0, s, x + i * (qk), a0);                                 \
                XN(grp_acc_##name)(b + i + 1, 0, s1, x + (i + 1) * (qk), a1);                      \
            }                                                                                      \
            if (i < nb) {                                                                          \
                XN(scales_##name)(b + i, s);                                                       \
                XN(grp_acc_##name)(b + i, 0, s, x + i * (qk), a0);                                 \
            }                                                                                      \
        }                                                                                          \
        return XN(hsum)(XN(add)(XN(fold)(a0), XN(fold)(a1)));                                      \
    }                                                                                              \
    XFN void XN(deq_##name)(const void *src, float *dst, int64_t n) {                              \
        const blk *b = src;                                                                        \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            XN(scales_##name)(b + i, s);                                                           \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                VECF w[X_NW];                                                                      \
                XN(dec_##name)(b + i, g, s, w, 0);                                                 \
                for (int v = 0; v < X_NW; v++) {                                                   \
                    XN(storeu)(dst + i * (qk) + 32 * g + LANES * v, w[v]);                         \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }

/* Several tokens per decoded block, NT <= 8: X_ACCS accumulators per token. */
#define DEF_MULTI_KERNELS(name, blk, qk)                                                           \
    XF __attribute__((always_inline)) void XN(dotn_body_##name)(                                   \
        const blk *b, const float *x, int64_t ldx, int64_t n, float *out, int64_t ldo,             \
        const int NT) {                                                                            \
        VECF acc[8][X_ACCS];                                                                       \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            for (int v = 0; v < X_ACCS; v++) acc[t][v] = XN(zero)();                               \
        }                                                                                          \
        float s[16];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            XN(scales_##name)(b + i, s);                                                           \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                VECF w[X_NW];                                                                      \
                const VECF f = XN(set1)(XN(grp_w_##name)(b + i, g, s, w));                         \
                const float *xb = x + i * (qk) + 32 * g;                                           \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    XN(grp_fma)(w, f, xb + t * ldx, acc[t]);                                       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = XN(hsum)(XN(fold)(acc[t]));                                             \
        }                                                                                          \
    }                                                                                              \
    XFN void XN(dotn_##name)(const void *row, const float *x, int64_t ldx, int64_t n, int nt,      \
                             float *out, int64_t ldo) {                                            \
        X_NT_SWITCH(nt, XN(dotn_body_##name), (const blk *)row, x, ldx, n, out, ldo)               \
    }

#define DEF_KERNELS(name, type, blk, qk) DEF_BLOCK_KERNELS(name, blk, qk) DEF_MULTI_KERNELS(name, blk, qk)
LM_BLOCK_TYPES(DEF_KERNELS)
#undef DEF_KERNELS
#undef DEF_BLOCK_KERNELS
#undef DEF_MULTI_KERNELS
#undef AFFINE
#undef AFFINE_SUB

/* ------------------------------------------------------------------ element types */
#define DEF_ELEM_KERNELS(name, esize, conv)                                                        \
    XFN float XN(dot_##name)(const void *row, const float *x, int64_t n) {                         \
        const uint8_t *p = row;                                                                    \
        VECF a0 = XN(zero)(), a1 = XN(zero)();                                                     \
        int64_t i = 0;                                                                             \
        for (; i + 2 * LANES <= n; i += 2 * LANES) {                                               \
            a0 = XN(fmadd)(XN(load_##name)(p + (esize) * i), XN(loadu)(x + i), a0);                \
            a1 = XN(fmadd)(XN(load_##name)(p + (esize) * (i + LANES)), XN(loadu)(x + i + LANES),   \
                           a1);                                                                    \
        }                                                                                          \
        float s = XN(hsum)(XN(add)(a0, a1));                                                       \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            s += v * x[i];                                                                         \
        }                                                                                          \
        return s;                                                                                  \
    }                                                                                              \
    XFN void XN(deq_##name)(const void *src, float *dst, int64_t n) {                              \
        const uint8_t *p = src;                                                                    \
        int64_t i = 0;                                                                             \
        for (; i + LANES <= n; i += LANES) {                                                       \
            XN(storeu)(dst + i, XN(load_##name)(p + (esize) * i));                                 \
        }                                                                                          \
        for (; i < n; i++) {                                                                       \
            float v;                                                                               \
            conv;                                                                                  \
            dst[i] = v;                                                                            \
        }                                                                                          \
    }

DEF_ELEM_KERNELS(f16, 2, v = XN(half_at)(p + 2 * i))
DEF_ELEM_KERNELS(bf16, 2, v = lm_bf16_to_float(lm_load_half(p + 2 * i)))
DEF_ELEM_KERNELS(f32, 4, memcpy(&v, p + 4 * i, 4))
#undef DEF_ELEM_KERNELS

/* ------------------------------------------------------------------ f32 vector helpers
 * The elements past the last whole vector: under a lane mask (X_MASKED_TAILS), with the
 * vector code's operations, or one by one in scalar code. */
XFN float XN(vdot_f32)(const float *a, const float *b, int64_t n) {
    VECF acc = XN(zero)();
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) acc = XN(fmadd)(XN(loadu)(a + i), XN(loadu)(b + i), acc);
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        acc = XN(fmadd)(XN(maskz_load)(m, a + i), XN(maskz_load)(m, b + i), acc);
    }
    return XN(hsum)(acc);
#else
    float s = XN(hsum)(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
#endif
}

XFN void XN(vaxpy_f32)(float *y, float a, const float *x, int64_t n) {
    const VECF va = XN(set1)(a);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        XN(storeu)(y + i, XN(fmadd)(va, XN(loadu)(x + i), XN(loadu)(y + i)));
    }
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        XN(mask_store)(y + i, m, XN(fmadd)(va, XN(maskz_load)(m, x + i), XN(maskz_load)(m, y + i)));
    }
#else
    for (; i < n; i++) y[i] += a * x[i];
#endif
}

XFN void XN(scale_axpy_f32)(float *y, float a, float b, float *z, int64_t n) {
    const VECF va = XN(set1)(a), vb = XN(set1)(b);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const VECF s = XN(mul)(va, XN(loadu)(y + i));
        XN(storeu)(y + i, s);
        XN(storeu)(z + i, XN(fmadd)(vb, s, XN(loadu)(z + i)));
    }
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        const VECF s = XN(mul)(va, XN(maskz_load)(m, y + i));
        XN(mask_store)(y + i, m, s);
        XN(mask_store)(z + i, m, XN(fmadd)(vb, s, XN(maskz_load)(m, z + i)));
    }
#else
    for (; i < n; i++) {
        y[i] *= a;
        z[i] += b * y[i];
    }
#endif
}

XFN void XN(axpy2_f32)(float *y, float a, const float *x, float b, float *z, int64_t n) {
    const VECF va = XN(set1)(a), vb = XN(set1)(b);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const VECF s = XN(fmadd)(va, XN(loadu)(x + i), XN(loadu)(y + i));
        XN(storeu)(y + i, s);
        XN(storeu)(z + i, XN(fmadd)(vb, s, XN(loadu)(z + i)));
    }
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        const VECF s = XN(fmadd)(va, XN(maskz_load)(m, x + i), XN(maskz_load)(m, y + i));
        XN(mask_store)(y + i, m, s);
        XN(mask_store)(z + i, m, XN(fmadd)(vb, s, XN(maskz_load)(m, z + i)));
    }
#else
    for (; i < n; i++) {
        y[i] += a * x[i];
        z[i] += b * y[i];
    }
#endif
}

XFN void XN(vscale_f32)(float *y, float a, int64_t n) {
    const VECF va = XN(set1)(a);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) XN(storeu)(y + i, XN(mul)(va, XN(loadu)(y + i)));
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        XN(mask_store)(y + i, m, XN(mul)(va, XN(maskz_load)(m, y + i)));
    }
#else
    for (; i < n; i++) y[i] *= a;
#endif
}

/* max(v, m) is m where v is NaN: NaNs are skipped, as the portable loop skips them */
XFN float XN(scale_max)(float *y, float a, int64_t n) {
    const VECF va = XN(set1)(a);
    VECF mx = XN(set1)(-INFINITY);
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        const VECF v = XN(mul)(va, XN(loadu)(y + i));
        XN(storeu)(y + i, v);
        mx = XN(max)(v, mx);
    }
#if X_MASKED_TAILS
    if (i < n) {
        const XMASK m = XN(mask_tail)(n - i);
        const VECF v = XN(mul)(va, XN(maskz_load)(m, y + i));
        XN(mask_store)(y + i, m, v);
        mx = XN(mask_max)(mx, m, v);
    }
    return XN(hmax)(mx);
#else
    float best = XN(hmax)(mx);
    for (; i < n; i++) {
        y[i] *= a;
        best = y[i] > best ? y[i] : best;
    }
    return best;
#endif
}

/* ------------------------------------------------------------------ exp and activations
 * Cephes-style expf: n = round(x log2 e), r = x - n ln 2 (two-part), degree-6 polynomial,
 * times 2^n; about 1 ulp. Inputs below -87.3 give exactly 0 (masked logits stay 0). */
XF VECF XN(exp)(VECF x) {
    const XLIVE live = XN(ge)(x, XN(set1)(-87.3f));
    x = XN(min)(x, XN(set1)(X_EXP_MAX));
    const VECF n = XN(round)(XN(mul)(x, XN(set1)(1.44269504088896341f)));
    VECF r = XN(fnmadd)(n, XN(set1)(0.693359375f), x);
    r = XN(fnmadd)(n, XN(set1)(-2.12194440e-4f), r);
    VECF p = XN(set1)(1.9875691500e-4f);
    p = XN(fmadd)(p, r, XN(set1)(1.3981999507e-3f));
    p = XN(fmadd)(p, r, XN(set1)(8.3334519073e-3f));
    p = XN(fmadd)(p, r, XN(set1)(4.1665795894e-2f));
    p = XN(fmadd)(p, r, XN(set1)(1.6666665459e-1f));
    p = XN(fmadd)(p, r, XN(set1)(5.0000001201e-1f));
    p = XN(fmadd)(p, XN(mul)(r, r), XN(add)(r, XN(set1)(1.0f)));
    return XN(ldexp_live)(p, n, live);
}

XFN float XN(exp_sum)(float *x, int64_t n, float mx) {
    const VECF vm = XN(set1)(mx);
    VECF acc = XN(zero)();
    for (int64_t i = 0; i < n; i += LANES) {
        const XMASK m = XN(mask_first)(n - i);
        const VECF e = XN(exp)(XN(sub)(XN(maskz_load)(m, x + i), vm));
        XN(mask_store)(x + i, m, e);
        acc = XN(add)(acc, XN(mask_keep)(m, e));
    }
    return XN(hsum)(acc);
}

/* out = gate * up / (1 + exp(-k * a(gate))), a = identity (silu) or the gelu_tanh argument */
XF void XN(sigmoid_mul)(float *out, const float *gate, const float *up, int64_t n, int gelu) {
    const VECF one = XN(set1)(1.0f);
    for (int64_t i = 0; i < n; i += LANES) {
        const XMASK m = XN(mask_first)(n - i);
        const VECF g = XN(maskz_load)(m, gate + i);
        VECF a;
        if (gelu) {
            const VECF g3 = XN(mul)(XN(mul)(g, g), g);
            a = XN(mul)(XN(set1)(-2.0f * 0.7978845608028654f),
                        XN(fmadd)(XN(set1)(0.044715f), g3, g));
        } else {
            a = XN(sub)(XN(zero)(), g);
        }
        const VECF num = XN(mul)(g, XN(maskz_load)(m, up + i));
        XN(mask_store)(out + i, m, XN(div)(num, XN(add)(one, XN(exp)(a))));
    }
}

XFN void XN(silu_mul)(float *out, const float *gate, const float *up, int64_t n) {
    XN(sigmoid_mul)(out, gate, up, n, 0);
}

XFN void XN(gelu_mul)(float *out, const float *gate, const float *up, int64_t n) {
    XN(sigmoid_mul)(out, gate, up, n, 1);
}

/* ------------------------------------------------------------------ GEMM micro-kernel
 * X_MR weight rows (two vectors) x X_GEMM_NR tokens (broadcasts): 2 X_GEMM_NR accumulators,
 * all in registers (12 of AVX2's 16, 24 of AVX-512's 32). */
#define X_MR (2 * LANES)

XFN void XN(gemm)(const float *a, const float *b, int64_t k, float *c) {
    VECF ca[X_GEMM_NR], cb[X_GEMM_NR];
    _Pragma("GCC unroll 12") for (int t = 0; t < X_GEMM_NR; t++) ca[t] = cb[t] = XN(zero)();
    for (int64_t p = 0; p < k; p++) {
        const VECF a0 = XN(load)(a + p * X_MR), a1 = XN(load)(a + p * X_MR + LANES);
        const float *bp = b + p * X_GEMM_NR;
        _Pragma("GCC unroll 12") for (int t = 0; t < X_GEMM_NR; t++) {
            const VECF bt = XN(bcast)(bp + t);
            ca[t] = XN(fmadd)(a0, bt, ca[t]);
            cb[t] = XN(fmadd)(a1, bt, cb[t]);
        }
    }
    _Pragma("GCC unroll 12") for (int t = 0; t < X_GEMM_NR; t++) {
        XN(storeu)(c + t * X_MR, ca[t]);
        XN(storeu)(c + t * X_MR + LANES, cb[t]);
    }
}

/* ------------------------------------------------------------------ int16 products, Q2_0
 * (the integer path of dotq.c) A group's 32 integers (code - 1) widened to int16; per token,
 * madd with the group's int16 activations, one convert and one FMA by the block scale times
 * the group's step. Every token runs the same operations whatever the number of tokens, so
 * a token's result does not depend on the batch it is computed in. */
/* Token t0 + t's int16 activations (q, cols apart: x->q or its quads) and group factors. */
XF __attribute__((always_inline)) void XN(dotq_rows)(const lm_xq *x, int64_t t0,
                                                     const int16_t *q, int64_t cols, const int NT,
                                                     const int16_t **xq, const float **ds) {
    _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {
        xq[t] = q + (t0 + t) * cols;
        ds[t] = x->ds + (t0 + t) * (x->n / 16);
    }
}

/* The products of the blocks of 32 (Q4_0 .. Q8_0) that an ISA file defines, over the
 * int16 activations q (cols apart) of each token: step(b, G, nb, NT, xq, ds, acc, off) adds
 * the products of blocks b[0 .. nb) (nb = STEP, group G on) to every token's sums, last those
 * of the row's remaining blocks (nb < STEP); the products of Q4_1 / Q5_1's mins (pair) gather
 * in off's odd lanes. */
#define DEF_DOTQ32(attr, name, blk, q, cols, STEP, step, last, pair)                               \
    attr static inline __attribute__((always_inline)) void XN(dotq_body_##name)(                   \
        const blk *b, const lm_xq *x, int64_t t0, float *out, int64_t ldo, const int NT) {         \
        const int64_t n = x->n, nb = n / 32;                                                       \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        XN(dotq_rows)(x, t0, q, cols, NT, xq, ds);                                                 \
        VECF acc[LM_DOTQ_TOKENS];                                                                  \
        XHALF off[LM_DOTQ_TOKENS];                                                                 \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            acc[t] = XN(zero)();                                                                   \
            off[t] = XN(half_zero)();                                                              \
        }                                                                                          \
        int64_t i = 0;                                                                             \
        for (; i + (STEP) <= nb; i += (STEP)) step(b + i, i, (STEP), NT, xq, ds, acc, off);        \
        if (i < nb) last(b + i, i, (int)(nb - i), NT, xq, ds, acc, off);                           \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = XN(hsum)(acc[t]) + XN(odd_sum)(off[t], (pair));                         \
        }                                                                                          \
    }                                                                                              \
    attr static void XN(dotq_##name)(const void *row, const lm_xq *x, int64_t t0, int nt,          \
                                     float *out, int64_t ldo) {                                    \
        X_NT_SWITCH(nt, XN(dotq_body_##name), (const blk *)row, x, t0, out, ldo)                   \
    }

#define DEF_DOTQ_Q2(name, blk, qk)                                                                 \
    XF __attribute__((always_inline)) void XN(dotq_body_##name)(                                   \
        const blk *b, const lm_xq *x, int64_t t0, float *out, int64_t ldo, const int NT) {         \
        const int64_t n = x->n, nb = n / (qk);                                                     \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        XN(dotq_rows)(x, t0, x->q, n, NT, xq, ds);                                                 \
        VECF acc[LM_DOTQ_TOKENS];                                                                  \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) acc[t] = XN(zero)();                  \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            const float d = lm_f16(&b[i].d);                                                       \
            for (int g = 0; g < (qk) / 32; g++) {                                                  \
                const int64_t G = i * ((qk) / 32) + g;                                             \
                __m128i lo, hi;                                                                    \
                VECI w[X_NW / 2];                                                                  \
                XN(q2_ints8)(b[i].qs + 8 * g, &lo, &hi);                                           \
                XN(i8x32_i16)(lo, hi, w);                                                          \
                _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                             \
                    const int16_t *xg = xq[t] + 32 * G;                                            \
                    VECI sg = XN(madd)(w[0], XN(loadu_i)(xg));                                     \
                    for (int k = 1; k < X_NW / 2; k++) {                                           \
                        sg = XN(add_i32)(sg, XN(madd)(w[k], XN(loadu_i)(xg + 2 * LANES * k)));     \
                    }                                                                              \
                    acc[t] = XN(fmadd)(XN(cvt_i32)(sg), XN(set1)(d * ds[t][2 * G]), acc[t]);       \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = XN(hsum)(acc[t]);                                                       \
        }                                                                                          \
    }                                                                                              \
    XFN void XN(dotq_##name)(const void *row, const lm_xq *x, int64_t t0, int nt, float *out,      \
                             int64_t ldo) {                                                        \
        X_NT_SWITCH(nt, XN(dotq_body_##name), (const blk *)row, x, t0, out, ldo)                   \
    }
DEF_DOTQ_Q2(q2_0, block_q2_0, QK2)
DEF_DOTQ_Q2(q2_0_128, block_q2_0_128, QK2L)
#undef DEF_DOTQ_Q2

/* ------------------------------------------------------------------ attention, several queries
 * Each K / V row is read (and widened) once for all the queries of a pass; each score and
 * each output dimension gets the operations the AVX2 row kernels give it. */

/* The blocks of four keys of NQ (1 .. X_QK_QUERIES) queries: a vector holds X_KEYS keys'
 * eight elements, so 4 / X_KEYS accumulators a query. */
XF __attribute__((always_inline)) void XN(qk_group)(const float *const *q, const void *k,
                                                    int64_t ks, int64_t nb, int hd, __m128 vs,
                                                    float *const *s, __m128 *vmx, int half,
                                                    const int NQ) {
    for (int64_t j = 0; j < nb; j += 4) {
        kv_prefetch_four(k, j, nb, ks, hd, half);
        VECF a[X_QK_QUERIES][4 / X_KEYS];
        for (int t = 0; t < NQ; t++) {
            for (int r = 0; r < 4 / X_KEYS; r++) a[t][r] = XN(zero)();
        }
        for (int d = 0; d < hd; d += 8) {
            for (int r = 0; r < 4 / X_KEYS; r++) {
                const VECF kv = XN(ld_keys)(k, (j + X_KEYS * r) * ks + d, ks, half);
                for (int t = 0; t < NQ; t++) {
                    a[t][r] = XN(fmadd)(XN(ld_q8)(q[t] + d), kv, a[t][r]);
                }
            }
        }
        for (int t = 0; t < NQ; t++) {
            const __m128 sc = _mm_mul_ps(XN(sum4)(a[t]), vs);
            vmx[t] = _mm_max_ps(vmx[t], sc);
            _mm_storeu_ps(s[t] + j, sc);
        }
    }
}

/* y_qk_scores_kv for nq queries over the same keys, X_QK_QUERIES at a time. */
XFN void XN(qk_scores_n)(const float *const *q, int nq, const void *k, int half, int64_t ks,
                         int64_t n, int hd, float scale, float *const *s, float *mx) {
    if (hd % 8 != 0) {
        for (int i = 0; i < nq; i++) mx[i] = y_qk_scores_kv(q[i], k, ks, n, hd, scale, s[i], half);
        return;
    }
    const __m128 vs = _mm_set1_ps(scale);
    const int64_t nb = n / 4 * 4;
    for (int i = 0; i < nq; i += X_QK_QUERIES) {
        __m128 vmx[X_QK_QUERIES];
        for (int t = 0; t < X_QK_QUERIES; t++) vmx[t] = _mm_set1_ps(-INFINITY);
        const int nt = nq - i < X_QK_QUERIES ? nq - i : X_QK_QUERIES;
        switch (nt) {
#if X_QK_QUERIES > 3
        case 6: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 6); break;
        case 5: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 5); break;
        case 4: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 4); break;
#endif
        case 3: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 3); break;
        case 2: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 2); break;
        default: XN(qk_group)(q + i, k, ks, nb, hd, vs, s + i, vmx, half, 1); break;
        }
        for (int t = 0; t < nt; t++) {
            mx[i + t] =
                y_qk_singles(q[i + t], k, ks, nb, n, hd, scale, s[i + t], y_max4(vmx[t]), half);
        }
    }
}

/* out[t][d0 .. d0 + NV LANES) for NQ (1..4) queries, each dimension summed over the keys in
 * order (so a pass's width changes no bits). */
XF __attribute__((always_inline)) void XN(pv_group)(const float *const *p, const void *v,
                                                    int64_t vs, int64_t n, int hd, int d0,
                                                    float *const *out, int half, const int NQ,
                                                    const int NV) {
    VECF o[4][64 / LANES];
    for (int t = 0; t < NQ; t++) {
        for (int r = 0; r < NV; r++) o[t][r] = XN(zero)();
    }
    for (int64_t j = 0; j < n; j++) {
        if (d0 == 0 && j + KV_AHEAD < n) kv_prefetch(v, (j + KV_AHEAD) * vs, hd, half);
        VECF vr[64 / LANES];
        for (int r = 0; r < NV; r++) vr[r] = XN(ld_kv)(v, j * vs + d0 + LANES * r, half);
        for (int t = 0; t < NQ; t++) {
            const VECF pj = XN(set1)(p[t][j]);
            for (int r = 0; r < NV; r++) o[t][r] = XN(fmadd)(pj, vr[r], o[t][r]);
        }
    }
    for (int t = 0; t < NQ; t++) {
        for (int r = 0; r < NV; r++) XN(storeu)(out[t] + d0 + LANES * r, o[t][r]);
    }
}

#define X_PV_GROUPS(nt, nv)                                                                        \
    switch (nt) {                                                                                  \
    case 4: XN(pv_group)(p + i, v, vs, n, hd, d0, out + i, half, 4, nv); break;                    \
    case 3: XN(pv_group)(p + i, v, vs, n, hd, d0, out + i, half, 3, nv); break;                    \
    case 2: XN(pv_group)(p + i, v, vs, n, hd, d0, out + i, half, 2, nv); break;                    \
    default: XN(pv_group)(p + i, v, vs, n, hd, d0, out + i, half, 1, nv); break;                   \
    }

/* y_pv_sum_kv for nq queries over the same values, four at a time. */
XFN void XN(pv_sum_n)(const float *const *p, int nq, const void *v, int half, int64_t vs,
                      int64_t n, int hd, float *const *out) {
    if (hd % 16 != 0) {
        for (int i = 0; i < nq; i++) y_pv_sum_kv(p[i], v, vs, n, hd, out[i], half);
        return;
    }
    for (int i = 0; i < nq; i += 4) {
        const int nt = nq - i < 4 ? nq - i : 4;
        int d0 = 0;
#if X_PV_WIDE
        for (; d0 + 64 <= hd; d0 += 64) X_PV_GROUPS(nt, 64 / LANES)
#endif
        for (; d0 < hd; d0 += 16) X_PV_GROUPS(nt, 16 / LANES)
    }
}
#undef X_PV_GROUPS

/* ------------------------------------------------------------------ installation */
static void XN(kernels_body)(lm_kernels *k) {
#define SET_ELEM(name, type)                                                                       \
    k->dequant[type] = XN(deq_##name);                                                             \
    k->dot[type] = XN(dot_##name);
#define SET_BLOCK(name, type, blk, qk)                                                             \
    SET_ELEM(name, type)                                                                           \
    k->dotn[type] = XN(dotn_##name);
    LM_ELEM_TYPES(SET_ELEM)
    LM_BLOCK_TYPES(SET_BLOCK)
#undef SET_BLOCK
#undef SET_ELEM
    k->gemm = XN(gemm);
    k->mr = X_MR;
    k->nr = X_GEMM_NR;
    k->dot_f32 = XN(vdot_f32);
    k->axpy_f32 = XN(vaxpy_f32);
    k->scale_axpy_f32 = XN(scale_axpy_f32);
    k->axpy2_f32 = XN(axpy2_f32);
    k->scale_f32 = XN(vscale_f32);
    k->scale_max = XN(scale_max);
    k->exp_sum = XN(exp_sum);
    k->silu_mul = XN(silu_mul);
    k->gelu_mul = XN(gelu_mul);
    k->qk_scores_n = XN(qk_scores_n);
    k->pv_sum_n = XN(pv_sum_n);
    k->dotq[LM_Q2_0] = XN(dotq_q2_0);
    k->dotq[LM_Q2_0_128] = XN(dotq_q2_0_128);
}

#undef X_NW
#undef X_ACCS
#undef X_MR
