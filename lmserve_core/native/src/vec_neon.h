/*
 * The vector layer on AArch64 NEON with the dot-product instructions: what r16_kernels.h is
 * written over, included once with V_I8MM 0 (FEAT_DotProd: sdot, udot) and once with
 * V_I8MM 1 (FEAT_I8MM too: usdot).
 *
 * Sixteen rows' int32 or float values are four 128-bit vectors (rows 4l .. 4l + 3 in vector
 * l); a tile row (16 rows x 4 bytes) is four vectors of 16 bytes, each lane of four bytes
 * one row's elements, which is the layout sdot reads: a row's four bytes times a token's four
 * give that row's int32 lane. With I8MM, usdot multiplies x's unsigned low bytes by the
 * signed weights directly; without it, udot multiplies them by the unsigned weights (ws + C)
 * and the group's sum of low bytes takes C back out (V_LO_WU). No products are widened to
 * int16, so Q8_0 multiplies its bytes too.
 */
#include <arm_neon.h>

#if V_I8MM
#define VN(name) name##_i8mm
#define VF __attribute__((target("arch=armv8.2-a+dotprod+i8mm"), always_inline)) static inline
#define VFN __attribute__((target("arch=armv8.2-a+dotprod+i8mm"))) static
#define V_LO_WU 0
#else
#define VN(name) name##_dotprod
#define VF __attribute__((target("arch=armv8.2-a+dotprod"), always_inline)) static inline
#define VFN __attribute__((target("arch=armv8.2-a+dotprod"))) static
#define V_LO_WU 1
#endif
#define V_HI_WU 0
#define V_BYTES_Q8 1
/* a token's l and h sums are eight of the 32 registers */
#define V_TOKENS 4
/* the bytes serve every pass: dot products need no widening */
#define V_PASS_TOKENS LM_DOTQ_TOKENS
#define V_WORDS_FROM (V_PASS_TOKENS + 1)
#define V_INT_PREFILL 1

typedef struct {
    uint8x16_t v[4];
} VN(vtile);
typedef struct {
    int32x4_t v[4];
} VN(vrows);
typedef struct {
    float32x4_t v[4];
} VN(vrowsf);
/* Words (unused here: V_WORDS_FROM is past every pass): row r's four products in lane r. */
typedef struct {
    int16x8_t v[8];
} VN(vwords);
typedef struct {
    int32x4_t v[16];
} VN(vpairs);

/* ------------------------------------------------------------------ tiles (bytes) */
VF VN(vtile) VN(tile_load)(const void *p) {
    VN(vtile) t;
    for (int l = 0; l < 4; l++) t.v[l] = vld1q_u8((const uint8_t *)p + 16 * l);
    return t;
}

/* tile rows 2c, 2c + 1 of a Q4 column's packed nibbles (lm_r16_nibble_at) */
VF void VN(tile_q4)(const uint8_t *qs, int c, VN(vtile) *r0, VN(vtile) *r1) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    for (int l = 0; l < 4; l++) {
        const uint8x16_t p = vld1q_u8(qs + 64 * c + 16 * l);
        const uint8x16_t lo = vandq_u8(p, m4), hi = vshrq_n_u8(p, 4);
        r0->v[l] = vzip1q_u8(lo, hi);
        r1->v[l] = vzip2q_u8(lo, hi);
    }
}

VF VN(vtile) VN(tile_sub)(VN(vtile) t, int c) {
    for (int l = 0; l < 4; l++) t.v[l] = vsubq_u8(t.v[l], vdupq_n_u8((uint8_t)c));
    return t;
}

VF VN(vtile) VN(tile_xor)(VN(vtile) t, int c) {
    for (int l = 0; l < 4; l++) t.v[l] = veorq_u8(t.v[l], vdupq_n_u8((uint8_t)c));
    return t;
}

/* a | (b & m), bytewise */
VF VN(vtile) VN(tile_or_and)(VN(vtile) a, VN(vtile) b, int m) {
    for (int l = 0; l < 4; l++) a.v[l] = vorrq_u8(a.v[l], vandq_u8(b.v[l], vdupq_n_u8((uint8_t)m)));
    return a;
}

/* shifts of the 16-bit words the bytes pair into (callers mask what crosses a byte) */
VF VN(vtile) VN(tile_sll16)(VN(vtile) t, int n) {
    for (int l = 0; l < 4; l++)
        t.v[l] = vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(t.v[l]), vdupq_n_s16((int16_t)n)));
    return t;
}

VF VN(vtile) VN(tile_srl16)(VN(vtile) t, int n) {
    for (int l = 0; l < 4; l++)
        t.v[l] = vreinterpretq_u8_u16(vshlq_u16(vreinterpretq_u16_u8(t.v[l]), vdupq_n_s16((int16_t)-n)));
    return t;
}

/* ------------------------------------------------------------------ byte products */
VF uint8x16_t VN(quad)(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return vreinterpretq_u8_u32(vdupq_n_u32(v));
}

/* acc += x's low bytes (unsigned) . the weights: signed with I8MM, else unsigned (ws + C) */
VF VN(vrows) VN(dot_lo)(VN(vrows) acc, VN(vtile) ws, VN(vtile) wu, const uint8_t *x4) {
    const uint8x16_t x = VN(quad)(x4);
#if V_I8MM
    (void)wu;
    for (int l = 0; l < 4; l++) acc.v[l] = vusdotq_s32(acc.v[l], x, vreinterpretq_s8_u8(ws.v[l]));
#else
    (void)ws;
    for (int l = 0; l < 4; l++)
        acc.v[l] = vreinterpretq_s32_u32(vdotq_u32(vreinterpretq_u32_s32(acc.v[l]), wu.v[l], x));
#endif
    return acc;
}

/* acc += ws (signed) . x's high bytes (signed) */
VF VN(vrows) VN(dot_hi)(VN(vrows) acc, VN(vtile) ws, VN(vtile) wu, const uint8_t *x4) {
    (void)wu;
    const int8x16_t x = vreinterpretq_s8_u8(VN(quad)(x4));
    for (int l = 0; l < 4; l++) acc.v[l] = vdotq_s32(acc.v[l], vreinterpretq_s8_u8(ws.v[l]), x);
    return acc;
}

/* ------------------------------------------------------------------ word products */
VF VN(vwords) VN(widen)(VN(vtile) t) {
    VN(vwords) w;
    for (int l = 0; l < 4; l++) {
        const int8x16_t s = vreinterpretq_s8_u8(t.v[l]);
        w.v[2 * l] = vmovl_s8(vget_low_s8(s));
        w.v[2 * l + 1] = vmovl_high_s8(s);
    }
    return w;
}

VF VN(vpairs) VN(pairs_zero)(void) {
    VN(vpairs) p;
    for (int r = 0; r < 16; r++) p.v[r] = vdupq_n_s32(0);
    return p;
}

VF VN(vpairs) VN(dot_words)(VN(vpairs) acc, const VN(vwords) *w, const int16_t *x4) {
    const int16x4_t x = vld1_s16(x4);
    for (int k = 0; k < 8; k++) {
        acc.v[2 * k] = vmlal_s16(acc.v[2 * k], vget_low_s16(w->v[k]), x);
        acc.v[2 * k + 1] = vmlal_s16(acc.v[2 * k + 1], vget_high_s16(w->v[k]), x);
    }
    return acc;
}

VF void VN(pairs_keep)(VN(vpairs) *p) {
    for (int r = 0; r < 16; r++) __asm__("" : "+w"(p->v[r]));
}

VF VN(vrows) VN(pairs_fold)(VN(vpairs) p) {
    VN(vrows) r;
    for (int l = 0; l < 4; l++)
        r.v[l] = vpaddq_s32(vpaddq_s32(p.v[4 * l], p.v[4 * l + 1]),
                            vpaddq_s32(p.v[4 * l + 2], p.v[4 * l + 3]));
    return r;
}

/* ------------------------------------------------------------------ rows of int32 */
VF VN(vrows) VN(rows_set1)(int32_t c) {
    VN(vrows) r;
    for (int l = 0; l < 4; l++) r.v[l] = vdupq_n_s32(c);
    return r;
}

VF VN(vrows) VN(rows_load)(const void *p) {
    VN(vrows) r;
    for (int l = 0; l < 4; l++) r.v[l] = vld1q_s32((const int32_t *)p + 4 * l);
    return r;
}

VF VN(vrows) VN(rows_add)(VN(vrows) a, VN(vrows) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vaddq_s32(a.v[l], b.v[l]);
    return a;
}

/* a * 256 + b */
VF VN(vrows) VN(rows_hi_lo)(VN(vrows) a, VN(vrows) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vaddq_s32(vshlq_n_s32(a.v[l], 8), b.v[l]);
    return a;
}

VF VN(vrows) VN(rows_and)(VN(vrows) a, uint32_t m) {
    for (int l = 0; l < 4; l++) a.v[l] = vandq_s32(a.v[l], vdupq_n_s32((int32_t)m));
    return a;
}

VF VN(vrows) VN(rows_or)(VN(vrows) a, VN(vrows) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vorrq_s32(a.v[l], b.v[l]);
    return a;
}

VF VN(vrows) VN(rows_srl)(VN(vrows) a, int n) {
    for (int l = 0; l < 4; l++)
        a.v[l] = vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a.v[l]), vdupq_n_s32(-n)));
    return a;
}

VF VN(vrows) VN(rows_sll)(VN(vrows) a, int n) {
    for (int l = 0; l < 4; l++) a.v[l] = vshlq_s32(a.v[l], vdupq_n_s32(n));
    return a;
}

/* a tile row as the 16 rows' four bytes, one int32 a row; and byte j of each, signed */
VF VN(vrows) VN(rows_of_tile)(VN(vtile) t) {
    VN(vrows) r;
    for (int l = 0; l < 4; l++) r.v[l] = vreinterpretq_s32_u8(t.v[l]);
    return r;
}

VF VN(vrows) VN(rows_byte)(VN(vrows) a, int j) {
    for (int l = 0; l < 4; l++)
        a.v[l] = vshlq_s32(vshlq_s32(a.v[l], vdupq_n_s32(24 - 8 * j)), vdupq_n_s32(-24));
    return a;
}

/* ------------------------------------------------------------------ rows of floats */
VF VN(vrowsf) VN(rowsf_zero)(void) {
    VN(vrowsf) r;
    for (int l = 0; l < 4; l++) r.v[l] = vdupq_n_f32(0.0f);
    return r;
}

VF VN(vrowsf) VN(rowsf_set1)(float c) {
    VN(vrowsf) r;
    for (int l = 0; l < 4; l++) r.v[l] = vdupq_n_f32(c);
    return r;
}

/* sixteen halves, exactly */
VF VN(vrowsf) VN(rowsf_half)(const lm_half *p) {
    VN(vrowsf) r;
    for (int l = 0; l < 4; l++) r.v[l] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * l)));
    return r;
}

/* sixteen signed bytes */
VF VN(vrowsf) VN(rowsf_i8)(const int8_t *p) {
    const int8x16_t v = vld1q_s8(p);
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    VN(vrowsf) r;
    r.v[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo)));
    r.v[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    r.v[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi)));
    r.v[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
    return r;
}

VF VN(vrowsf) VN(rowsf_cvt)(VN(vrows) a) {
    VN(vrowsf) r;
    for (int l = 0; l < 4; l++) r.v[l] = vcvtq_f32_s32(a.v[l]);
    return r;
}

VF VN(vrowsf) VN(rowsf_mul)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vmulq_f32(a.v[l], b.v[l]);
    return a;
}

VF VN(vrowsf) VN(rowsf_add)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vaddq_f32(a.v[l], b.v[l]);
    return a;
}

VF VN(vrowsf) VN(rowsf_sub)(VN(vrowsf) a, VN(vrowsf) b) {
    for (int l = 0; l < 4; l++) a.v[l] = vsubq_f32(a.v[l], b.v[l]);
    return a;
}

/* fma(a, b, c), rounded once */
VF VN(vrowsf) VN(rowsf_fma)(VN(vrowsf) a, VN(vrowsf) b, VN(vrowsf) c) {
    for (int l = 0; l < 4; l++) c.v[l] = vfmaq_f32(c.v[l], a.v[l], b.v[l]);
    return c;
}

/* fma(-a, b, c), rounded once */
VF VN(vrowsf) VN(rowsf_fnma)(VN(vrowsf) a, VN(vrowsf) b, VN(vrowsf) c) {
    for (int l = 0; l < 4; l++) c.v[l] = vfmsq_f32(c.v[l], a.v[l], b.v[l]);
    return c;
}

VF void VN(rowsf_store)(float *p, VN(vrowsf) a) {
    for (int l = 0; l < 4; l++) vst1q_f32(p + 4 * l, a.v[l]);
}

