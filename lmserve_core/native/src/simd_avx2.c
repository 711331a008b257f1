/*
 * AVX2 + FMA + F16C kernels: simd_x86_body.h over vecf_avx2.h, and the kernels only this
 * file defines (the attention rows, the f16 conversions, the int16 activations and the
 * integer products of the blocks of 32 and the super-blocks), which the AVX-512 table
 * keeps too, but for the products that VNNI gives the blocks of 32.
 * Compiled with per-function target attributes so the same binary runs on any x86-64;
 * dispatch.c installs them only when the CPU has the features.
 */
#include "lm_internal.h"

#if LM_HAVE_X86
#include <immintrin.h>
#include <math.h>

#include "vecf_avx2.h"

/* ------------------------------------------------------------------ attention rows
 * K / V rows are f32 or f16 (widened by F16C on load, exactly); `half` is a constant at every
 * call, so each variant compiles to its own loop, and both run the same float operations:
 * rows converted to f32 beforehand give the same bits as the f16 rows. */
static inline float y_kv_at(const void *base, int64_t i, int half) {
    return half ? lm_f16((const uint16_t *)base + i) : ((const float *)base)[i];
}

/* Scores of keys j .. j + nk - 1 (nk 4 or 8) into s; returns vmx with their maximum. */
XF __attribute__((always_inline)) __m128 y_qk_block(
    const float *q, const void *k, int64_t j, int64_t ks, int hd, __m128 vs, float *s,
    __m128 vmx, int half, const int nk) {
    __m256 a[8];
    for (int r = 0; r < nk; r++) a[r] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int r = 0; r < nk; r++) {
            a[r] = _mm256_fmadd_ps(qv, y_ld_kv(k, (j + r) * ks + d, half), a[r]);
        }
    }
    for (int r = 0; r < nk; r += 4) {
        const __m128 sc = _mm_mul_ps(y_sum4(a + r), vs);
        vmx = _mm_max_ps(vmx, sc);
        _mm_storeu_ps(s + j + r, sc);
    }
    return vmx;
}

/* Rows this far ahead of the one being read are prefetched: a kv head's rows are strided
 * (every kv head of a position is one cache row), which the hardware prefetchers follow
 * too late for a decode step's attention over a long context. */
#define KV_AHEAD 16

/* The hd elements of a K or V row, from element i of the cache, on their way to L1. */
static inline void kv_prefetch(const void *base, int64_t i, int hd, int half) {
    const char *at = (const char *)base + i * (half ? 2 : 4);
    for (int off = 0; off < hd * (half ? 2 : 4); off += 64) __builtin_prefetch(at + off, 0, 3);
}

/* The rows of keys j + KV_AHEAD .. j + KV_AHEAD + 3 (of nb, ks elements apart) on their way
 * to L1, ahead of a block of four keys. */
static inline void kv_prefetch_four(const void *k, int64_t j, int64_t nb, int64_t ks, int hd,
                                    int half) {
    if (j + KV_AHEAD + 4 <= nb) {
        for (int r = 0; r < 4; r++) kv_prefetch(k, (j + KV_AHEAD + r) * ks, hd, half);
    }
}

/* The largest lane of vmx, the maximum of the scores it has seen. */
XF float y_max4(__m128 vmx) {
    vmx = _mm_max_ps(vmx, _mm_movehl_ps(vmx, vmx));
    vmx = _mm_max_ss(vmx, _mm_movehdup_ps(vmx));
    return _mm_cvtss_f32(vmx);
}

/* Scores of keys j .. n - 1 one at a time (the keys after the blocks of four, or all of them
 * when hd is not a multiple of eight); returns the maximum of mx and theirs. */
XF float y_qk_singles(const float *q, const void *k, int64_t ks, int64_t j,
                      int64_t n, int hd, float scale, float *s, float mx,
                      int half) {
    for (; j < n; j++) {
        __m256 acc = _mm256_setzero_ps();
        int d = 0;
        for (; d + 8 <= hd; d += 8) {
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), y_ld_kv(k, j * ks + d, half), acc);
        }
        float dot = y_hsum(acc);
        for (; d < hd; d++) {
            dot += q[d] * y_kv_at(k, j * ks + d, half);
        }
        s[j] = dot * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

XF float y_qk_scores_kv(const float *q, const void *k, int64_t ks, int64_t n,
                        int hd, float scale, float *s, int half) {
    float mx = -INFINITY;
    int64_t j = 0;
    if (hd % 8 == 0) {
        const __m128 vs = _mm_set1_ps(scale);
        __m128 vmx = _mm_set1_ps(-INFINITY);
        /* eight keys at a time (eight FMA chains in flight), then four */
        for (; j + 8 <= n; j += 8) vmx = y_qk_block(q, k, j, ks, hd, vs, s, vmx, half, 8);
        for (; j + 4 <= n; j += 4) vmx = y_qk_block(q, k, j, ks, hd, vs, s, vmx, half, 4);
        mx = y_max4(vmx);
    }
    return y_qk_singles(q, k, ks, j, n, hd, scale, s, mx, half);
}

/* out[d0 .. d0 + 8 nv) = sum_j p[j] v[j][...]: nv FMA chains, each dim summed over the keys
 * in order (so a pass's width changes no bits). */
XF __attribute__((always_inline)) void y_pv_pass(const float *p, const void *v,
                                                 int64_t vs, int64_t n, int d0,
                                                 float *out, int half,
                                                 const int nv) {
    __m256 o[8];
    for (int r = 0; r < nv; r++) o[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const int64_t row = j * vs + d0;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int r = 0; r < nv; r++) {
            o[r] = _mm256_fmadd_ps(pj, y_ld_kv(v, row + 8 * r, half), o[r]);
        }
    }
    for (int r = 0; r < nv; r++) _mm256_storeu_ps(out + d0 + 8 * r, o[r]);
}

XF void y_pv_sum_kv(const float *p, const void *v, int64_t vs, int64_t n, int hd,
                    float *out, int half) {
    int d0 = 0;
    for (; d0 + 64 <= hd; d0 += 64) y_pv_pass(p, v, vs, n, d0, out, half, 8);
    for (; d0 + 32 <= hd; d0 += 32) y_pv_pass(p, v, vs, n, d0, out, half, 4);
    for (; d0 + 8 <= hd; d0 += 8) y_pv_pass(p, v, vs, n, d0, out, half, 1);
    for (; d0 < hd; d0++) {
        float o = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            o += p[j] * y_kv_at(v, j * vs + d0, half);
        }
        out[d0] = o;
    }
}

#include "simd_x86_body.h"

XFN float y_qk_scores(const float *q, const float *k, int64_t ks, int64_t n, int hd,
                      float scale, float *s) {
    return y_qk_scores_kv(q, k, ks, n, hd, scale, s, 0);
}

XFN float y_qk_scores_f16(const float *q, const uint16_t *k, int64_t ks, int64_t n,
                          int hd, float scale, float *s) {
    return y_qk_scores_kv(q, k, ks, n, hd, scale, s, 1);
}

XFN void y_pv_sum(const float *p, const float *v, int64_t vs, int64_t n, int hd,
                  float *out) {
    y_pv_sum_kv(p, v, vs, n, hd, out, 0);
}

XFN void y_pv_sum_f16(const float *p, const uint16_t *v, int64_t vs, int64_t n, int hd,
                      float *out) {
    y_pv_sum_kv(p, v, vs, n, hd, out, 1);
}

XFN void y_f16_to_f32(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    }
    for (; i < n; i++) {
        y[i] = lm_f16(x + i);
    }
}

XFN void y_f32_to_f16(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(y + i), h);
    }
    for (; i < n; i++) {
        y[i] = lm_float_to_half(x[i]);
    }
}

/* ------------------------------------------------------------------ int16 activations
 * (the integer path of dotq.c). A group's weights widen to two vectors of 16 int16, madd
 * multiplies them with the activations' int16 in pairs, and the int32 sums (exact) take the
 * group's float factors. */
XFN void y_quant_x16(const float *x, int64_t n, int16_t *q, float *ds) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t g = 0; g < n / 32; g++) {
        const float *xg = x + 32 * g;
        const __m256 v0 = _mm256_loadu_ps(xg), v1 = _mm256_loadu_ps(xg + 8);
        const __m256 v2 = _mm256_loadu_ps(xg + 16), v3 = _mm256_loadu_ps(xg + 24);
        const __m256 a = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
            _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float amax = _mm_cvtss_f32(m);
        const float sum = y_hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        int16_t *qg = q + 32 * g;
        if (!isfinite(sum) || !isfinite(amax)) {
            ds[2 * g] = ds[2 * g + 1] = NAN;
            memset(qg, 0, 32 * sizeof *qg);
            continue;
        }
        const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
        const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv));
        const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
        const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv));
        const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
        /* packs works per 128-bit lane: put the quarters back in order */
        _mm256_storeu_si256((__m256i *)qg,
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8));
        _mm256_storeu_si256((__m256i *)(qg + 16),
                            _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8));
        ds[2 * g] = amax / 32767.0f;
        ds[2 * g + 1] = sum;
    }
}

/* ------------------------------------------------------------------ group factors
 * Blocks of 32: the f16 fields, lane 0 the scale and lane 1 the min (F16C). */
XF __m128 y_half1(const lm_half *p) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128(lm_load_half(p)));
}

XF __m128 y_half2(const lm_half *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)v));
}

#define y_fac_q4_0(b) y_half1(&(b)->d)
#define y_fac_q4_1(b) y_half2(&(b)->d) /* the min follows the scale */
#define y_fac_q5_0(b) y_half1(&(b)->d)
#define y_fac_q5_1(b) y_half2(&(b)->d)
#define y_fac_q8_0(b) y_half1(&(b)->d)

/* Super-blocks: y_gfac8_<type>(b, fa, fb, fm) gives the eight groups' factors: fa the scale
 * (of the first sixteen for Q6_K), fb Q6_K's scale of the second sixteen, fm the offset. */
XF void y_deinterleave(const float *p, __m256 *even, __m256 *odd) {
    const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
    /* shuffle works per 128-bit lane: put the 64-bit quarters back in order */
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* Q4_K / Q5_K: fa = d * scale_g, fm = -dmin * min_g. */
#define DEF_GFAC_KQ(name, blk)                                                                     \
    XF void y_gfac8_##name(const blk *b, __m256 *fa, __m256 *fb, __m256 *fm) {                     \
        uint8_t u[16];                                                                             \
        lm_kq_unpack(b->scales, u);                                                                \
        *fa = _mm256_mul_ps(y_u8_ps(_mm_loadl_epi64((const __m128i *)u)),                          \
                            _mm256_set1_ps(lm_f16(&b->d)));                                        \
        *fb = _mm256_setzero_ps();                                                                 \
        *fm = _mm256_mul_ps(y_u8_ps(_mm_loadl_epi64((const __m128i *)(u + 8))),                    \
                            _mm256_set1_ps(-lm_f16(&b->dmin)));                                    \
    }
DEF_GFAC_KQ(q4_K, block_q4_K)
DEF_GFAC_KQ(q5_K, block_q5_K)
#undef DEF_GFAC_KQ

/* Q6_K: group g's sixteens use scales 2g and 2g + 1. */
XF void y_gfac8_q6_K(const block_q6_K *b, __m256 *fa, __m256 *fb, __m256 *fm) {
    float s[16];
    y_scales_q6_K(b, s);
    y_deinterleave(s, fa, fb);
    *fm = _mm256_setzero_ps();
}

/* ------------------------------------------------------------------ group integers
 * y_ints_<type>(b, g, w): group g of block b as int16, elements 0..15 in w[0], 16..31 in w[1]. */
XF void y_ints_u8(__m128i lo, __m128i hi, __m256i w[2]) {
    w[0] = _mm256_cvtepu8_epi16(lo);
    w[1] = _mm256_cvtepu8_epi16(hi);
}

XF void y_ints_i8(__m128i lo, __m128i hi, __m256i w[2]) {
    w[0] = _mm256_cvtepi8_epi16(lo);
    w[1] = _mm256_cvtepi8_epi16(hi);
}

/* 16 bytes widened to int16: the low nibbles of each are elements 0..15, the high ones
 * 16..31, separated by one and / one shift. */
XF __m256i y_bytes_u16(const uint8_t *p) {
    return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
}

XF void y_ints_q4_0(const block_q4_0 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i v = y_bytes_u16(b->qs), off = _mm256_set1_epi16(8);
    w[0] = _mm256_sub_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x0F)), off);
    w[1] = _mm256_sub_epi16(_mm256_srli_epi16(v, 4), off);
}

XF void y_ints_q4_1(const block_q4_1 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i v = y_bytes_u16(b->qs);
    w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
    w[1] = _mm256_srli_epi16(v, 4);
}

XF void y_ints_q5_0(const block_q5_0 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i q = _mm256_sub_epi8(y_q5_bytes(b->qs, b->qh), _mm256_set1_epi8(16));
    y_ints_i8(y_lo128(q), y_hi128(q), w);
}

XF void y_ints_q5_1(const block_q5_1 *b, int g, __m256i w[2]) {
    (void)g;
    const __m256i q = y_q5_bytes(b->qs, b->qh);
    y_ints_u8(y_lo128(q), y_hi128(q), w);
}

XF void y_ints_q8_0(const block_q8_0 *b, int g, __m256i w[2]) {
    (void)g;
    y_ints_i8(_mm_loadu_si128((const __m128i *)b->qs),
              _mm_loadu_si128((const __m128i *)(b->qs + 16)), w);
}

/* Group g of a Q4_K/Q5_K super-block from its 32 bytes (low nibbles for even g, high for
 * odd), widened to int16 before the nibble is picked. */
XF void y_kq_nibbles16(const uint8_t *qs, int g, __m256i w[2]) {
    const __m256i lo = y_bytes_u16(qs + 32 * (g / 2)), hi = y_bytes_u16(qs + 32 * (g / 2) + 16);
    if (g & 1) {
        w[0] = _mm256_srli_epi16(lo, 4);
        w[1] = _mm256_srli_epi16(hi, 4);
    } else {
        w[0] = _mm256_and_si256(lo, _mm256_set1_epi16(0x0F));
        w[1] = _mm256_and_si256(hi, _mm256_set1_epi16(0x0F));
    }
}

XF void y_ints_q4_K(const block_q4_K *b, int g, __m256i w[2]) {
    y_kq_nibbles16(b->qs, g, w);
}

XF void y_ints_q5_K(const block_q5_K *b, int g, __m256i w[2]) {
    /* bit g of each qh byte, moved to bit 4 */
    const __m256i h0 = y_bytes_u16(b->qh), h1 = y_bytes_u16(b->qh + 16);
    const __m256i bit = _mm256_set1_epi16((short)(1 << g));
    y_kq_nibbles16(b->qs, g, w);
    w[0] = _mm256_or_si256(w[0], _mm256_srli_epi16(_mm256_slli_epi16(_mm256_and_si256(h0, bit), 4), g));
    w[1] = _mm256_or_si256(w[1], _mm256_srli_epi16(_mm256_slli_epi16(_mm256_and_si256(h1, bit), 4), g));
}

XF void y_ints_q6_K(const block_q6_K *b, int g, __m256i w[2]) {
    const __m256i q = y_q6_bytes(b, g);
    y_ints_i8(y_lo128(q), y_hi128(q), w);
}

XF __m256 y_lane0(__m128 v) {
    return _mm256_broadcastss_ps(v);
}

/* Every token below runs the same sequence of operations whatever the number of tokens, so
 * a token's result does not depend on the batch it is computed in. */

/* Blocks of 32, two at a time (G and G + 1). A token's integer sums of the two blocks are
 * folded into one vector, block G's four in the low half and G + 1's in the high half, so
 * that one convert and one FMA by the pair's factors (lanes 0 and 2 of p, spread over the
 * halves) serve both; the offsets of Q4_1 / Q5_1 gather in lanes 1 and 3 of off[t]. The
 * weights' integers and factors are prepared once for the NT <= LM_DOTQ_TOKENS tokens.
 * Against a group at a time, this halves the per-token factor work (one load, multiply and
 * spread per pair), which with the two products per group is what several tokens cost:
 * about 10% off the products of a verify or batch pass of up to 8 rows. One accumulator per
 * token: the pair's work covers the FMA's latency. The body's DEF_DOTQ32 runs the pairs. */
#define DEF_DOTQ_32(name, blk, fac)                                                                \
    XF __attribute__((always_inline)) void y_dotq_pair_##name(                                     \
        const blk *b, int64_t G, int nb, const int NT, const int16_t *const *xq,                   \
        const float *const *ds, __m256 *acc, __m128 *off) {                                        \
        (void)nb;                                                                                  \
        __m256i u[2], v[2];                                                                        \
        y_ints_##name(b, 0, u);                                                                    \
        y_ints_##name(b + 1, 0, v);                                                                \
        const __m128 fw = _mm_movelh_ps(y_fac_##name(b), y_fac_##name(b + 1));                     \
        const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i *x = (const __m256i *)(xq[t] + 32 * G);                                  \
            const __m256i sg = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(x)),    \
                                                _mm256_madd_epi16(u[1], _mm256_loadu_si256(x + 1))); \
            const __m256i sh = _mm256_add_epi32(_mm256_madd_epi16(v[0], _mm256_loadu_si256(x + 2)), \
                                                _mm256_madd_epi16(v[1], _mm256_loadu_si256(x + 3))); \
            const __m256i s = _mm256_add_epi32(_mm256_blend_epi32(sg, sh, 0xF0),                   \
                                               _mm256_permute2x128_si256(sg, sh, 0x21));           \
            const __m128 p = _mm_mul_ps(fw, _mm_loadu_ps(ds[t] + 2 * G));                          \
            acc[t] = _mm256_fmadd_ps(                                                              \
                _mm256_cvtepi32_ps(s),                                                             \
                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(p), spread), acc[t]);              \
            if ((fac) == 1) off[t] = _mm_add_ps(off[t], p);                                        \
        }                                                                                          \
    }                                                                                              \
    /* the last block of a row of an odd count, alone */                                           \
    XF __attribute__((always_inline)) void y_dotq_last_##name(                                     \
        const blk *b, int64_t G, int nb, const int NT, const int16_t *const *xq,                   \
        const float *const *ds, __m256 *acc, __m128 *off) {                                        \
        (void)nb;                                                                                  \
        __m256i u[2];                                                                              \
        y_ints_##name(b, 0, u);                                                                    \
        const __m128 fw = y_fac_##name(b);                                                         \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i *x = (const __m256i *)(xq[t] + 32 * G);                                  \
            const __m256i sg = _mm256_add_epi32(_mm256_madd_epi16(u[0], _mm256_loadu_si256(x)),    \
                                                _mm256_madd_epi16(u[1], _mm256_loadu_si256(x + 1))); \
            const __m128 p = _mm_mul_ps(                                                           \
                fw, _mm_castpd_ps(_mm_load_sd((const double *)(ds[t] + 2 * G))));                  \
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sg), y_lane0(p), acc[t]);                  \
            if ((fac) == 1) off[t] = _mm_add_ps(off[t], p);                                        \
        }                                                                                          \
    }                                                                                              \
    DEF_DOTQ32(XT, name, blk, x->q, n, 2, y_dotq_pair_##name, y_dotq_last_##name, (fac))

/* Super-blocks: each token's factors for the super-block's eight groups are multiplied out
 * first, cf[g] = fa[g] * d_g (Q6_K: cf[2g], cf[2g + 1] for its two sixteens), with the
 * offsets' fm[g] * sum_g into off; a group's per-token work is then two madd, one add, one
 * convert and one FMA. */
XF __attribute__((always_inline)) void y_fold8(const float *ds, __m256 fa, __m256 fb, __m256 fm,
                                               const int fac, float *cf, __m256 *off) {
    __m256 d, s;
    y_deinterleave(ds, &d, &s);
    const __m256 f = _mm256_mul_ps(fa, d);
    if (fac == 2) {
        const __m256 h = _mm256_mul_ps(fb, d);
        const __m256 lo = _mm256_unpacklo_ps(f, h), hi = _mm256_unpackhi_ps(f, h);
        _mm256_storeu_ps(cf, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(cf + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    } else {
        _mm256_storeu_ps(cf, f);
    }
    if (fac == 1) *off = _mm256_fmadd_ps(fm, s, *off);
}

#define DEF_DOTQ_KQ(name, blk, fac)                                                                \
    XF __attribute__((always_inline)) void y_dotq_grp_##name(                                      \
        const blk *b, int g, int64_t G, const int NT, const int16_t *const *xq,                    \
        float (*cf)[16], __m256 *acc) {                                                            \
        __m256i w[2];                                                                              \
        y_ints_##name(b, g, w);                                                                    \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            const __m256i p0 =                                                                     \
                _mm256_madd_epi16(w[0], _mm256_loadu_si256((const __m256i *)(xq[t] + 32 * G)));    \
            const __m256i p1 = _mm256_madd_epi16(                                                  \
                w[1], _mm256_loadu_si256((const __m256i *)(xq[t] + 32 * G + 16)));                 \
            if ((fac) == 2) {                                                                      \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),                                   \
                                         _mm256_broadcast_ss(cf[t] + 2 * g), acc[t]);              \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),                                   \
                                         _mm256_broadcast_ss(cf[t] + 2 * g + 1), acc[t]);          \
            } else {                                                                               \
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),             \
                                         _mm256_broadcast_ss(cf[t] + g), acc[t]);                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    XF __attribute__((always_inline)) void y_dotq_body_##name(                                     \
        const blk *b, const lm_xq *x, int64_t t0, float *out, int64_t ldo, const int NT) {         \
        const int64_t n = x->n, nb = n / 256;                                                      \
        const int16_t *xq[LM_DOTQ_TOKENS];                                                         \
        const float *ds[LM_DOTQ_TOKENS];                                                           \
        y_dotq_rows(x, t0, x->q, n, NT, xq, ds);                                                   \
        __m256 a0[LM_DOTQ_TOKENS], a1[LM_DOTQ_TOKENS], off[LM_DOTQ_TOKENS];                        \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            a0[t] = a1[t] = off[t] = _mm256_setzero_ps();                                          \
        }                                                                                          \
        float cf[LM_DOTQ_TOKENS][16];                                                              \
        for (int64_t i = 0; i < nb; i++) {                                                         \
            __m256 fa, fb, fm;                                                                     \
            y_gfac8_##name(b + i, &fa, &fb, &fm);                                                  \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                 \
                y_fold8(ds[t] + 16 * i, fa, fb, fm, (fac), cf[t], &off[t]);                        \
            }                                                                                      \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g += 2) {                               \
                y_dotq_grp_##name(b + i, g, 8 * i + g, NT, xq, cf, a0);                            \
                y_dotq_grp_##name(b + i, g + 1, 8 * i + g + 1, NT, xq, cf, a1);                    \
            }                                                                                      \
        }                                                                                          \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                     \
            out[t * ldo] = y_hsum(_mm256_add_ps(a0[t], a1[t])) + y_hsum(off[t]);                   \
        }                                                                                          \
    }                                                                                              \
    XFN void y_dotq_##name(const void *row, const lm_xq *x, int64_t t0, int nt, float *out,        \
                           int64_t ldo) {                                                          \
        X_NT_SWITCH(nt, y_dotq_body_##name, (const blk *)row, x, t0, out, ldo)                     \
    }

DEF_DOTQ_32(q4_0, block_q4_0, 0)
DEF_DOTQ_32(q4_1, block_q4_1, 1)
DEF_DOTQ_32(q5_0, block_q5_0, 0)
DEF_DOTQ_32(q5_1, block_q5_1, 1)
DEF_DOTQ_32(q8_0, block_q8_0, 0)
DEF_DOTQ_KQ(q4_K, block_q4_K, 1)
DEF_DOTQ_KQ(q5_K, block_q5_K, 1)
DEF_DOTQ_KQ(q6_K, block_q6_K, 2)
#undef DEF_DOTQ_32
#undef DEF_DOTQ_KQ

void lm_kernels_avx2(lm_kernels *k) {
    y_kernels_body(k);
    k->qk_scores = y_qk_scores;
    k->pv_sum = y_pv_sum;
    k->qk_scores_f16 = y_qk_scores_f16;
    k->pv_sum_f16 = y_pv_sum_f16;
    k->f32_to_f16 = y_f32_to_f16;
    k->f16_to_f32 = y_f16_to_f32;
    k->quant_x16 = y_quant_x16;
#define SET_DOTQ(name, type, blk, qk) k->dotq[type] = y_dotq_##name;
    LM_BLOCK_TYPES(SET_DOTQ)
#undef SET_DOTQ
}

#undef y_fac_q4_0
#undef y_fac_q4_1
#undef y_fac_q5_0
#undef y_fac_q5_1
#undef y_fac_q8_0
#undef X_NT_SWITCH
#undef DEF_DOTQ32
#include "vecf_end.h"
#endif /* LM_HAVE_X86 */
