/*
 * AVX-512 emulated by SIMDe, for the kernel harnesses (tests/native/*.c) on a CPU without it:
 * force-included (gcc -include simde_avx512.h -mavx2 -mfma -mf16c) before the whole kernel
 * library, it turns the library's target attributes into nothing, reports every CPU feature
 * as present, and maps the _mm512_* (and AVX-512 VL) intrinsics onto SIMDe's portable / AVX2
 * code, so dispatch.c installs the AVX-512 table and its kernels run here.
 * tests/test_kernels_avx512_emulated.py builds and runs them.
 *
 * Checked with Debian's libsimde-dev 0.7.4; what that version lacks (or aliases wrongly) is
 * defined below, lane by lane. The reductions add (or compare) the lanes in the order of
 * GCC's own _mm512_reduce_* so that the emulated sums have the hardware's bits.
 */
#ifndef LM_SIMDE_AVX512_H
#define LM_SIMDE_AVX512_H

#include <immintrin.h>
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

/* every function is built for the compiler's -m flags: AVX2 here, AVX-512 through SIMDe */
#define target(...)
#define __builtin_cpu_supports(feature) 1

/* the conversions: each of n lanes of a (field from) into r (field to), by C's conversion */
#define EMU_CONVERT(name, R, A, n, to, from)                                                       \
    static inline simde__##R name(simde__##A a) {                                                  \
        simde__##A##_private p = simde__##A##_to_private(a);                                       \
        simde__##R##_private r;                                                                    \
        for (int i = 0; i < (n); i++) r.to[i] = p.from[i];                                         \
        return simde__##R##_from_private(r);                                                       \
    }
EMU_CONVERT(emu_cvtepi32_ps, m512, m512i, 16, f32, i32)
EMU_CONVERT(emu_cvtepu8_epi32, m512i, m128i, 16, i32, u8)
EMU_CONVERT(emu_cvtepi8_epi32, m512i, m128i, 16, i32, i8)
EMU_CONVERT(emu_cvtepu16_epi32, m512i, m256i, 16, i32, u16)
EMU_CONVERT(emu_cvtepu8_epi16, m512i, m256i, 32, i16, u8)
#undef EMU_CONVERT
static inline simde__m512 emu_cvtph_ps(simde__m256i a) {
    simde__m512_private r;
    r.m256[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(a));
    r.m256[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1));
    return simde__m512_from_private(r);
}
static inline void emu_mask_storeu_ps(void *p, simde__mmask16 m, simde__m512 v) {
    simde__m512_private q = simde__m512_to_private(v);
    for (int i = 0; i < 16; i++)
        if (m >> i & 1) ((float *)p)[i] = q.f32[i];
}
static inline simde__m512 emu_maskz_loadu_ps(simde__mmask16 m, const void *p) {
    simde__m512_private r;
    for (int i = 0; i < 16; i++) r.f32[i] = (m >> i & 1) ? ((const float *)p)[i] : 0.0f;
    return simde__m512_from_private(r);
}
static inline __m256 emu_mm256_maskz_loadu_ps(simde__mmask8 m, const void *p) {
    float r[8];
    for (int i = 0; i < 8; i++) r[i] = (m >> i & 1) ? ((const float *)p)[i] : 0.0f;
    return _mm256_loadu_ps(r);
}
/* the reductions in the order GCC's headers add (or compare) the lanes: halves, then
 * quarters, ... */
static inline float emu_add(float a, float b) { return a + b; }
static inline float emu_max(float a, float b) { return a > b ? a : b; }
#define EMU_REDUCE(name, op)                                                                       \
    static inline float name(simde__m512 a) {                                                      \
        simde__m512_private p = simde__m512_to_private(a);                                         \
        float h[8];                                                                                \
        for (int i = 0; i < 8; i++) h[i] = op(p.f32[i], p.f32[i + 8]);                             \
        for (int w = 4; w >= 1; w /= 2)                                                            \
            for (int i = 0; i < w; i++) h[i] = op(h[i], h[i + w]);                                 \
        return h[0];                                                                               \
    }
EMU_REDUCE(emu_reduce_add_ps, emu_add)
EMU_REDUCE(emu_reduce_max_ps, emu_max)
#undef EMU_REDUCE
static inline int emu_reduce_add_epi32(simde__m512i a) {
    simde__m512i_private p = simde__m512i_to_private(a);
    uint32_t s = 0;
    for (int i = 0; i < 16; i++) s += (uint32_t)p.i32[i];
    return (int)s;
}

/* SIMDe 0.7.4 names its alias of the two-operand form with four */
#undef _mm512_madd_epi16
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 emu_cvtepu8_epi16
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#undef _mm256_maskz_loadu_ps
#define _mm256_maskz_loadu_ps emu_mm256_maskz_loadu_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 emu_reduce_add_epi32
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
#undef _mm512_shuffle_i64x2
#define _mm512_shuffle_i64x2 simde_mm512_shuffle_i64x2

#endif /* LM_SIMDE_AVX512_H */
