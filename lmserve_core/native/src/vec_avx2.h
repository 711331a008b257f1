/*
 * The vector layer on AVX2 (+ FMA, F16C): what r16_kernels.h is written over.
 *
 * Sixteen rows' int32 or float values are two 256-bit vectors (rows 0..7, 8..15); a tile row
 * (16 rows x 4 bytes, lmserve's interleaved layouts) is two vectors of 32 bytes, each 128-bit
 * lane holding four rows. Byte products go through vpmaddubsw (unsigned x signed bytes into
 * int16 pairs) and vpmaddwd (pairs into int32); its int16 pairs cannot hold a Q8_0 byte
 * times a low byte of x (255 * 128 * 2), so Q8_0 is multiplied as words (V_BYTES_Q8 0).
 */
#include <immintrin.h>

#define VN(name) name##_avx2
#define VF __attribute__((target("avx2,fma,f16c"), always_inline)) static inline
#define VFN __attribute__((target("avx2,fma,f16c"))) static
/* dot_lo multiplies x's low bytes (unsigned) by the signed weights; dot_hi the unsigned
 * weights (signed + C) by x's high bytes (signed): the group's sum of hi takes C back out */
#define V_LO_WU 0
#define V_HI_WU 1
#define V_BYTES_Q8 0
/* tokens a pass of byte products: four tokens' int32 sums are eight of the sixteen
 * registers; from two tokens a block's weights are widened to words once for all of them */
#define V_TOKENS 4
#define V_WORDS_FROM 2
/* most tokens a call (lm_kernels.r16_tokens): a block's words serve all of them */
#define V_PASS_TOKENS 16
/* prefill's products are decode's, so a token has the same bits in a prompt as alone; the
 * f32 GEMM (--prefill-precision f32) is up to 1.2x faster on Zen 3 (benchmarks/README.md) */
#define V_INT_PREFILL 1

typedef struct {
    __m256i v[2];
} VN(vtile);
typedef struct {
    __m256i v[2];
} VN(vrows);
typedef struct {
    __m256 v[2];
} VN(vrowsf);
/* Word products' int32 pair sums: vector k holds rows 4k .. 4k + 3, two lanes a row. */
typedef struct {
    __m256i v[4];
} VN(vpairs);

/* ------------------------------------------------------------------ tiles (bytes) */
VF VN(vtile) VN(tile_load)(const void *p) {
    VN(vtile) t;
    t.v[0] = _mm256_loadu_si256((const __m256i *)p);
    t.v[1] = _mm256_loadu_si256((const __m256i *)p + 1);
    return t;
}

/* tile rows 2c, 2c + 1 of a Q4 column's packed nibbles (lm_r16_nibble_at): the 64 bytes'
 * low and high nibbles interleaved byte by byte within each 128-bit lane */
VF void VN(tile_q4)(const uint8_t *qs, int c, VN(vtile) *r0, VN(vtile) *r1) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < 2; h++) {
        const __m256i p = _mm256_loadu_si256((const __m256i *)(qs + 64 * c) + h);
        const __m256i lo = _mm256_and_si256(p, m4);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
        r0->v[h] = _mm256_unpacklo_epi8(lo, hi);
        r1->v[h] = _mm256_unpackhi_epi8(lo, hi);
    }
}

VF VN(vtile) VN(tile_sub)(VN(vtile) t, int c) {
    for (int h = 0; h < 2; h++) t.v[h] = _mm256_sub_epi8(t.v[h], _mm256_set1_epi8((char)c));
    return t;
}

VF VN(vtile) VN(tile_xor)(VN(vtile) t, int c) {
    for (int h = 0; h < 2; h++) t.v[h] = _mm256_xor_si256(t.v[h], _mm256_set1_epi8((char)c));
    return t;
}

/* a | (b & m), bytewise */
VF VN(vtile) VN(tile_or_and)(VN(vtile) a, VN(vtile) b, int m) {
    for (int h = 0; h < 2; h++)
        a.v[h] = _mm256_or_si256(a.v[h], _mm256_and_si256(b.v[h], _mm256_set1_epi8((char)m)));
    return a;
}

/* shifts of the 16-bit words the bytes pair into (callers mask what crosses a byte) */
VF VN(vtile) VN(tile_sll16)(VN(vtile) t, int n) {
    for (int h = 0; h < 2; h++) t.v[h] = _mm256_sll_epi16(t.v[h], _mm_cvtsi32_si128(n));
    return t;
}

VF VN(vtile) VN(tile_srl16)(VN(vtile) t, int n) {
    for (int h = 0; h < 2; h++) t.v[h] = _mm256_srl_epi16(t.v[h], _mm_cvtsi32_si128(n));
    return t;
}

/* ------------------------------------------------------------------ byte products
 * Each row's four bytes times a token's four (x4, the quad at that address). */
VF int32_t VN(quad)(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* acc += x's low bytes (unsigned) . ws (signed); maddubs' pairs are at most 255 * 63 * 2 */
VF VN(vrows) VN(dot_lo)(VN(vrows) acc, VN(vtile) ws, VN(vtile) wu, const uint8_t *x4) {
    (void)wu;
    const __m256i x = _mm256_set1_epi32(VN(quad)(x4)), one = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++)
        acc.v[h] = _mm256_add_epi32(acc.v[h],
                                    _mm256_madd_epi16(_mm256_maddubs_epi16(x, ws.v[h]), one));
    return acc;
}

/* acc += wu (unsigned) . x's high bytes (signed) */
VF VN(vrows) VN(dot_hi)(VN(vrows) acc, VN(vtile) ws, VN(vtile) wu, const uint8_t *x4) {
    (void)ws;
    const __m256i x = _mm256_set1_epi32(VN(quad)(x4)), one = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++)
        acc.v[h] = _mm256_add_epi32(acc.v[h],
                                    _mm256_madd_epi16(_mm256_maddubs_epi16(wu.v[h], x), one));
    return acc;
}

/* ------------------------------------------------------------------ word products */
/* A tile row's signed bytes as words: vector k holds rows 4k .. 4k + 3, four words a row. */
typedef struct {
    __m256i v[4];
} VN(vwords);

VF VN(vwords) VN(widen)(VN(vtile) t) {
    VN(vwords) w;
    for (int h = 0; h < 2; h++) {
        w.v[2 * h] = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(t.v[h]));
        w.v[2 * h + 1] = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(t.v[h], 1));
    }
    return w;
}

VF VN(vpairs) VN(pairs_zero)(void) {
    VN(vpairs) p;
    for (int k = 0; k < 4; k++) p.v[k] = _mm256_setzero_si256();
    return p;
}

/* acc += the words times the token's four int16 at x4, by pairs */
VF VN(vpairs) VN(dot_words)(VN(vpairs) acc, const VN(vwords) *w, const int16_t *x4) {
    int64_t q;
    memcpy(&q, x4, sizeof q);
    const __m256i x = _mm256_set1_epi64x(q);
    for (int k = 0; k < 4; k++) acc.v[k] = _mm256_add_epi32(acc.v[k], _mm256_madd_epi16(w->v[k], x));
    return acc;
}

/* a chain of sums kept in order: regrouped, it would hold every product live at once */
VF void VN(pairs_keep)(VN(vpairs) *p) {
    for (int k = 0; k < 4; k++) __asm__("" : "+x"(p->v[k]));
}

/* the rows' sums of their lane pairs */
VF VN(vrows) VN(pairs_fold)(VN(vpairs) p) {
    VN(vrows) r;
    for (int h = 0; h < 2; h++) /* hadd per lane: rows 0 1 4 5 | 2 3 6 7, then in order */
        r.v[h] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(p.v[2 * h], p.v[2 * h + 1]), 0xD8);
    return r;
}

/* ------------------------------------------------------------------ rows of int32 */
VF VN(vrows) VN(rows_set1)(int32_t c) {
    VN(vrows) r;
    r.v[0] = r.v[1] = _mm256_set1_epi32(c);
    return r;
}

VF VN(vrows) VN(rows_load)(const void *p) {
    VN(vrows) r;
    r.v[0] = _mm256_loadu_si256((const __m256i *)p);
    r.v[1] = _mm256_loadu_si256((const __m256i *)p + 1);
    return r;
}

VF VN(vrows) VN(rows_add)(VN(vrows) a, VN(vrows) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_add_epi32(a.v[h], b.v[h]);
    return a;
}

/* a * 256 + b */
VF VN(vrows) VN(rows_hi_lo)(VN(vrows) a, VN(vrows) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_add_epi32(_mm256_slli_epi32(a.v[h], 8), b.v[h]);
    return a;
}

VF VN(vrows) VN(rows_and)(VN(vrows) a, uint32_t m) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_and_si256(a.v[h], _mm256_set1_epi32((int)m));
    return a;
}

VF VN(vrows) VN(rows_or)(VN(vrows) a, VN(vrows) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_or_si256(a.v[h], b.v[h]);
    return a;
}

VF VN(vrows) VN(rows_srl)(VN(vrows) a, int n) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_srl_epi32(a.v[h], _mm_cvtsi32_si128(n));
    return a;
}

VF VN(vrows) VN(rows_sll)(VN(vrows) a, int n) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_sll_epi32(a.v[h], _mm_cvtsi32_si128(n));
    return a;
}

/* a tile row as the 16 rows' four bytes, one int32 a row; and byte j of each, signed */
VF VN(vrows) VN(rows_of_tile)(VN(vtile) t) {
    VN(vrows) r;
    r.v[0] = t.v[0];
    r.v[1] = t.v[1];
    return r;
}

VF VN(vrows) VN(rows_byte)(VN(vrows) a, int j) {
    for (int h = 0; h < 2; h++)
        a.v[h] = _mm256_srai_epi32(_mm256_sll_epi32(a.v[h], _mm_cvtsi32_si128(24 - 8 * j)), 24);
    return a;
}

/* ------------------------------------------------------------------ rows of floats */
VF VN(vrowsf) VN(rowsf_zero)(void) {
    VN(vrowsf) r;
    r.v[0] = r.v[1] = _mm256_setzero_ps();
    return r;
}

VF VN(vrowsf) VN(rowsf_set1)(float c) {
    VN(vrowsf) r;
    r.v[0] = r.v[1] = _mm256_set1_ps(c);
    return r;
}

/* sixteen halves, exactly */
VF VN(vrowsf) VN(rowsf_half)(const lm_half *p) {
    VN(vrowsf) r;
    r.v[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    r.v[1] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p + 1));
    return r;
}

/* sixteen signed bytes */
VF VN(vrowsf) VN(rowsf_i8)(const int8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p);
    VN(vrowsf) r;
    r.v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    r.v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
    return r;
}

VF VN(vrowsf) VN(rowsf_cvt)(VN(vrows) a) {
    VN(vrowsf) r;
    for (int h = 0; h < 2; h++) r.v[h] = _mm256_cvtepi32_ps(a.v[h]);
    return r;
}

VF VN(vrowsf) VN(rowsf_mul)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_mul_ps(a.v[h], b.v[h]);
    return a;
}

VF VN(vrowsf) VN(rowsf_add)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_add_ps(a.v[h], b.v[h]);
    return a;
}

VF VN(vrowsf) VN(rowsf_sub)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int h = 0; h < 2; h++) a.v[h] = _mm256_sub_ps(a.v[h], b.v[h]);
    return a;
}

/* fma(a, b, c), rounded once */
VF VN(vrowsf) VN(rowsf_fma)(VN(vrowsf) a, VN(vrowsf) b, VN(vrowsf) c) {
    for (int h = 0; h < 2; h++) c.v[h] = _mm256_fmadd_ps(a.v[h], b.v[h], c.v[h]);
    return c;
}

/* fma(-a, b, c), rounded once */
VF VN(vrowsf) VN(rowsf_fnma)(VN(vrowsf) a, VN(vrowsf) b, VN(vrowsf) c) {
    for (int h = 0; h < 2; h++) c.v[h] = _mm256_fnmadd_ps(a.v[h], b.v[h], c.v[h]);
    return c;
}

VF void VN(rowsf_store)(float *p, VN(vrowsf) a) {
    _mm256_storeu_ps(p, a.v[0]);
    _mm256_storeu_ps(p + 8, a.v[1]);
}

