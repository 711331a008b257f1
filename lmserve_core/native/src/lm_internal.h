/*
 * Private declarations shared by the kernel sources: GGML block layouts, half-precision
 * conversion, the per-ISA kernel table and the pool's internal entry points.
 */
#ifndef LMSERVE_INTERNAL_H
#define LMSERVE_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lmserve/kernels.h"
#include "lmserve/api.h"

#if defined(__x86_64__) && !defined(LM_NO_SIMD)
#define LM_HAVE_X86 1
#else
#define LM_HAVE_X86 0
#endif
#if defined(__aarch64__) && !defined(LM_NO_SIMD)
#define LM_HAVE_NEON 1
#else
#define LM_HAVE_NEON 0
#endif

/* type ids are < 143: GGML's (< 43), lm_r16_type's (64 + GGML's) and LM_Q2_0_128 (142) */
#define LM_NTYPES 143
#define QK 32        /* elements of a legacy block */
#define QKK 256      /* elements of a K-quant super-block */
#define QK2 64       /* elements of a Q2_0 block */
#define QK2L 128     /* elements of a Q2_0_128 block */

/* X-macros over the encodings every kernel table covers, so each ISA file instantiates and
 * registers its kernels from one list. X(name, type id, block struct, elements per block) */
#define LM_BLOCK_TYPES(X)                                                                          \
    X(q4_0, LM_Q4_0, block_q4_0, QK)                                                               \
    X(q4_1, LM_Q4_1, block_q4_1, QK)                                                               \
    X(q5_0, LM_Q5_0, block_q5_0, QK)                                                               \
    X(q5_1, LM_Q5_1, block_q5_1, QK)                                                               \
    X(q8_0, LM_Q8_0, block_q8_0, QK)                                                               \
    X(q4_K, LM_Q4_K, block_q4_K, QKK)                                                              \
    X(q5_K, LM_Q5_K, block_q5_K, QKK)                                                              \
    X(q6_K, LM_Q6_K, block_q6_K, QKK)                                                              \
    X(q2_0, LM_Q2_0, block_q2_0, QK2)                                                              \
    X(q2_0_128, LM_Q2_0_128, block_q2_0_128, QK2L)
/* X(name, type id) of the plain element encodings. */
#define LM_ELEM_TYPES(X) X(f32, LM_F32) X(f16, LM_F16) X(bf16, LM_BF16)

/* ------------------------------------------------------------------ block layouts (GGML) */
typedef uint16_t lm_half;

typedef struct {
    lm_half d;
    uint8_t qs[QK / 2];
} block_q4_0; /* 18 bytes */

typedef struct {
    lm_half d;
    lm_half m;
    uint8_t qs[QK / 2];
} block_q4_1; /* 20 bytes */

typedef struct {
    lm_half d;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_0; /* 22 bytes */

typedef struct {
    lm_half d;
    lm_half m;
    uint8_t qh[4];
    uint8_t qs[QK / 2];
} block_q5_1; /* 24 bytes */

typedef struct {
    lm_half d;
    int8_t qs[QK];
} block_q8_0; /* 34 bytes */

typedef struct {
    lm_half d;
    lm_half dmin;
    uint8_t scales[12]; /* 8 x (6-bit scale, 6-bit min), packed */
    uint8_t qs[QKK / 2];
} block_q4_K; /* 144 bytes */

typedef struct {
    lm_half d;
    lm_half dmin;
    uint8_t scales[12];
    uint8_t qh[QKK / 8];
    uint8_t qs[QKK / 2];
} block_q5_K; /* 176 bytes */

typedef struct {
    uint8_t ql[QKK / 2];
    uint8_t qh[QKK / 4];
    int8_t scales[QKK / 16];
    lm_half d;
} block_q6_K; /* 210 bytes */

/* 2-bit codes, element j at bits 2 (j % 4) of qs[j / 4]; value (code - 1) * d. Q2_0 is
 * llama.cpp's block_q2_0; Q2_0_128 the same codes in blocks of 128 (PrismML's first
 * block_q2_0; its code order is taken from public notes on that fork, lmserve/types.h). */
typedef struct {
    lm_half d;
    uint8_t qs[QK2 / 4];
} block_q2_0; /* 18 bytes */

typedef struct {
    lm_half d;
    uint8_t qs[QK2L / 4];
} block_q2_0_128; /* 34 bytes */

_Static_assert(sizeof(block_q4_0) == 18, "q4_0");
_Static_assert(sizeof(block_q4_1) == 20, "q4_1");
_Static_assert(sizeof(block_q5_0) == 22, "q5_0");
_Static_assert(sizeof(block_q5_1) == 24, "q5_1");
_Static_assert(sizeof(block_q8_0) == 34, "q8_0");
_Static_assert(sizeof(block_q4_K) == 144, "q4_K");
_Static_assert(sizeof(block_q5_K) == 176, "q5_K");
_Static_assert(sizeof(block_q6_K) == 210, "q6_K");
_Static_assert(sizeof(block_q2_0) == 18, "q2_0");
_Static_assert(sizeof(block_q2_0_128) == 34, "q2_0_128");

/* ------------------------------------------------------------------ interleaved layouts
 * One block column of 16 rows (enum lm_r16_type): the rows' scales (and mins), then their
 * integers as 8 tile rows of 64 bytes (byte 4n + j of tile row R is element 4R + j of row n).
 * Q4's nibbles are packed so that two tile rows come out of 64 bytes by (b & 15, b >> 4)
 * byte interleaving within each 128-bit lane (lm_r16_nibble_at). */
#define R16 16 /* rows interleaved */
typedef struct {
    lm_half d[R16];
    uint8_t qs[R16 * QK / 2];
} r16_q4_0; /* 288 bytes: 16 x 18 */

typedef struct {
    lm_half d[R16];
    lm_half m[R16];
    uint8_t qs[R16 * QK / 2];
} r16_q4_1; /* 320 bytes: 16 x 20 */

typedef struct {
    lm_half d[R16];
    int8_t qs[R16 * QK];
} r16_q8_0; /* 544 bytes: 16 x 34 */

/* The super-blocks: per 16 rows and super-block of 256, the rows' factors, then their
 * integers as 64 tile rows (tile row R: elements 4R .. 4R + 3 of each row in turn). */
typedef struct {
    lm_half d[R16];
    lm_half dmin[R16];
    uint32_t sc[3][R16];       /* word w (bytes 4w .. 4w + 3) of row n's 12 packed scales */
    uint8_t qs[R16 * QKK / 2]; /* 64 tile rows of nibbles, packed as r16_q4_1's */
} r16_q4_K;                    /* 2304 bytes: 16 x 144 */

typedef struct {
    lm_half d[R16];
    int8_t sc[QKK / 16][R16];  /* scale i of row n */
    uint8_t ql[R16 * QKK / 2]; /* low nibbles of the 6-bit values, packed as r16_q4_1's */
    uint8_t qh[QKK / 16][64];  /* bits 2s, 2s + 1 of qh[i][p]: bits 4, 5 of byte p of
                                * tile row 4i + s */
} r16_q6_K;                    /* 3360 bytes: 16 x 210 */

_Static_assert(sizeof(r16_q4_0) == R16 * sizeof(block_q4_0), "r16 q4_0");
_Static_assert(sizeof(r16_q4_K) == R16 * sizeof(block_q4_K), "r16 q4_K");
_Static_assert(sizeof(r16_q6_K) == R16 * sizeof(block_q6_K), "r16 q6_K");
_Static_assert(sizeof(r16_q4_1) == R16 * sizeof(block_q4_1), "r16 q4_1");
_Static_assert(sizeof(r16_q8_0) == R16 * sizeof(block_q8_0), "r16 q8_0");

/* The GGML type an interleaved type holds (-1 for any other type). */
static inline int lm_r16_base(int type) {
    switch (type) {
    case LM_Q4_0_R16:
    case LM_Q4_1_R16:
    case LM_Q8_0_R16:
    case LM_Q4_K_R16:
    case LM_Q6_K_R16:
        return type - 64;
    default:
        return -1;
    }
}

/* Where element 4R + j of row n (tile byte 64R + 4n + j) sits in a Q4 column's packed qs:
 * byte index, and 0 / 4 for the low / high nibble. Each 64 packed bytes (chunk c) make tile
 * rows 2c and 2c + 1: lane l's bytes i (< 8) and 8 + i give bytes 2i, 2i + 1 of lane l of row
 * 2c and of row 2c + 1, low nibble first. */
static inline int lm_r16_nibble_at(int R, int p, int *shift) {
    const int l = p / 16, q = p % 16;
    *shift = 4 * (q & 1);
    return 64 * (R / 2) + 16 * l + 8 * (R & 1) + q / 2;
}

/* ------------------------------------------------------------------ scalar conversions */
static inline float lm_fp32_from_bits(uint32_t w) {
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint32_t lm_fp32_to_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    return w;
}

/* Unaligned little-endian loads (blocks are packed, 2-byte aligned at best). */
static inline lm_half lm_load_half(const void *p) {
    lm_half h;
    memcpy(&h, p, sizeof h);
    return h;
}

/* Exact IEEE half -> single, including subnormals, inf and NaN. */
static inline float lm_half_to_float(lm_half h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {
        /* subnormal: value = man * 2^-24, exact in single precision */
        float f = (float)man * 5.9604644775390625e-08f;
        bits = sign | lm_fp32_to_bits(f);
    }
    return lm_fp32_from_bits(bits);
}

/* Every half's float value, filled once at start-up: a scale becomes one load (which SIMD
 * code can broadcast straight from memory) instead of a conversion. */
extern float lm_f16_table[1 << 16];

static inline float lm_f16(const void *p) {
    return lm_f16_table[lm_load_half(p)];
}

/* Single -> half, rounding to nearest even (IEEE, as F16C and numpy do); NaN stays NaN. */
static inline lm_half lm_float_to_half(float f) {
    const uint32_t x = lm_fp32_to_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) { /* inf, nan */
        return (lm_half)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u | ((ax >> 13) & 0x3ffu) : 0));
    }
    if (ax >= 0x477ff000u) { /* >= 65520 rounds to inf */
        return (lm_half)(sign | 0x7c00u);
    }
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half (or zero) */
        if (ax < 0x33000000u) { /* below 2^-25, or exactly it (a tie to the even zero) */
            return (lm_half)sign;
        }
        const uint32_t e = ax >> 23;
        const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e; /* 14 .. 24 */
        uint32_t h = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        h += rem > half || (rem == half && (h & 1u));
        return (lm_half)(sign | h);
    }
    uint32_t h = (ax - 0x38000000u) >> 13; /* rebias the exponent, keep 10 mantissa bits */
    const uint32_t rem = ax & 0x1fffu;
    h += rem > 0x1000u || (rem == 0x1000u && (h & 1u)); /* a carry moves into the exponent */
    return (lm_half)(sign | h);
}

static inline float lm_bf16_to_float(uint16_t h) {
    return lm_fp32_from_bits((uint32_t)h << 16);
}

/* 6-bit scale and min j (0..7) of a Q4_K/Q5_K super-block. */
static inline void lm_scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ------------------------------------------------------------------ block scales as floats
 * s[] receives what a block's groups are multiplied by: 32-blocks {d, m} (m = -8d, -16d for
 * Q4_0, Q5_0); Q2_0 and Q2_0_128 {d}; Q4_K/Q5_K
 * s[g] = d * scale_g and s[8 + g] = dmin * min_g; Q6_K s[i] = d * scales[i]. */
/* All eight 6-bit scales then all eight mins of a Q4_K/Q5_K super-block, as bytes u[0..15]
 * (the lm_scale_min_k4 unpacking done four bytes at a time). */
static inline void lm_kq_unpack(const uint8_t *scales, uint8_t u[16]) {
    uint32_t w[3], o[4];
    memcpy(w, scales, sizeof w);
    o[0] = w[0] & 0x3f3f3f3fu;                                             /* scales 0..3 */
    o[1] = (w[2] & 0x0f0f0f0fu) | (((w[0] >> 6) & 0x03030303u) << 4);     /* scales 4..7 */
    o[2] = w[1] & 0x3f3f3f3fu;                                             /* mins 0..3 */
    o[3] = ((w[2] >> 4) & 0x0f0f0f0fu) | (((w[1] >> 6) & 0x03030303u) << 4); /* mins 4..7 */
    memcpy(u, o, sizeof o);
}

static inline void lm_scales_kq(const uint8_t *scales, float d, float dmin, float *s) {
    uint8_t u[16];
    lm_kq_unpack(scales, u);
    for (int j = 0; j < 8; j++) {
        s[j] = d * (float)u[j];
        s[8 + j] = dmin * (float)u[8 + j];
    }
}

static inline void lm_scales_q4_0(const block_q4_0 *b, float *s) {
    s[0] = lm_f16(&b->d);
    s[1] = -8.0f * s[0]; /* exact: a power-of-two multiple */
}

static inline void lm_scales_q4_1(const block_q4_1 *b, float *s) {
    s[0] = lm_f16(&b->d);
    s[1] = lm_f16(&b->m);
}

static inline void lm_scales_q5_0(const block_q5_0 *b, float *s) {
    s[0] = lm_f16(&b->d);
    s[1] = -16.0f * s[0];
}

static inline void lm_scales_q5_1(const block_q5_1 *b, float *s) {
    s[0] = lm_f16(&b->d);
    s[1] = lm_f16(&b->m);
}

static inline void lm_scales_q8_0(const block_q8_0 *b, float *s) {
    s[0] = lm_f16(&b->d);
}

static inline void lm_scales_q2_0(const block_q2_0 *b, float *s) {
    s[0] = lm_f16(&b->d);
}

static inline void lm_scales_q2_0_128(const block_q2_0_128 *b, float *s) {
    s[0] = lm_f16(&b->d);
}

/* The 2-bit code of element j of a Q2_0 / Q2_0_128 block's qs. */
static inline int lm_q2_code(const uint8_t *qs, int j) {
    return (qs[j / 4] >> (2 * (j % 4))) & 3;
}

static inline void lm_scales_q4_K(const block_q4_K *b, float *s) {
    lm_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

static inline void lm_scales_q5_K(const block_q5_K *b, float *s) {
    lm_scales_kq(b->scales, lm_f16(&b->d), lm_f16(&b->dmin), s);
}

static inline void lm_scales_q6_K(const block_q6_K *b, float *s) {
    const float d = lm_f16(&b->d);
    for (int i = 0; i < 16; i++) {
        s[i] = d * (float)b->scales[i];
    }
}

/* ------------------------------------------------------------------ per-ISA kernel table */
/* dst[0..n) = decoded src; n is a multiple of the type's block. */
typedef void (*lm_dequant_fn)(const void *src, float *dst, int64_t n);
/* dot(row, x) over n elements; n is a multiple of the type's block. */
typedef float (*lm_dot_fn)(const void *row, const float *x, int64_t n);
/* out[t * ldo] = dot(row, x + t * ldx) for t < nt (1..8): each block decoded once. */
typedef void (*lm_dotn_fn)(const void *row, const float *x, int64_t ldx, int64_t n, int nt,
                           float *out, int64_t ldo);
/* Activations quantized for the integer dot products: each token's n values (n a multiple
 * of 32) as int16 in groups of 32, value ~= q * d; per group ds[2g] = d and ds[2g + 1] = the
 * group's exact f32 sum (for the weights' offsets). Token t: q + t * n, ds + t * (n / 16). */
typedef struct {
    int16_t *q;
    float *ds;
    int64_t n;
    /* The same integers in quads (lm_kernels.quads_x16), or NULL when the table's kernels
     * read q only. Token t: q4 + t * LM_QUAD_COLS(n). */
    int16_t *q4;
    /* The same integers as bytes (lm_kernels.bytes_x16), or NULL when no kernel of the
     * table reads them. Token t: b + t * LM_BYTE_COLS(n). */
    uint8_t *b;
} lm_xq;

/* One token's x[0..n) into q and ds (n a multiple of 32): d = max|x| / 32767 per group,
 * q = round-to-nearest-even(x * (32767 / max|x|)); a group with a non-finite value gets
 * d = NaN, so every product with it is NaN as in f32. q and d are bit-identical on every
 * ISA (the sums may round differently). */
typedef void (*lm_quant_x16_fn)(const float *x, int64_t n, int16_t *q, float *ds);
/* A token's quantized x rearranged by quads of groups, for kernels that multiply four groups
 * in one 512-bit vector: quad Q (groups 4Q..4Q+3, zeros past the last group) fills
 * q4[128 Q .. 128 Q + 128) as four vectors of 32, vector k holding elements 8k..8k+7 of each
 * of the four groups in turn. */
typedef void (*lm_quads_x16_fn)(const int16_t *q, int64_t n, int16_t *q4);
#define LM_QUAD_COLS(n) (((n) + 127) / 128 * 128)
/* A token's quantized x as bytes, for kernels that multiply bytes: q = 256 hi + lo with
 * hi = q >> 8 (arithmetic, -128..127) and lo = q & 255 (0..255); b[0 .. n) holds lo,
 * b[n .. 2n) hi, from b + 2n the int32 sum of hi over each group of 32, then that of lo
 * (for the tables whose kernels read it). */
typedef void (*lm_bytes_x16_fn)(const int16_t *q, int64_t n, uint8_t *b);
#define LM_BYTE_COLS(n) (2 * (n) + (n) / 32 * 8)
/* out[t * ldo] = dot(row, token t0 + t of x) for t < nt (1..LM_DOTQ_TOKENS), integer products
 * per group: each weight group is unpacked once for all nt tokens. */
#define LM_DOTQ_TOKENS 8
typedef void (*lm_dotq_fn)(const void *row, const lm_xq *x, int64_t t0, int nt, float *out,
                           int64_t ldo);
/* Products with an interleaved matrix: y[t * ldy + 16 g + n] for tokens t0 .. t0 + nt - 1
 * (nt <= lm_kernels.r16_tokens; y points at token t0's row) and rows 16 g + n of the ng
 * column groups at w. Per output, every kernel runs the same float operations in the same
 * order (the integer sum of each block exact, then acc = fma(sum, f * d, acc) and, for a type
 * with mins, acc = fma(m, s, acc), block after block), so an output has the same bits
 * whichever kernel, ISA, token count or thread computed it. */
typedef void (*lm_dotq_r16_fn)(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,
                               float *y, int64_t ldy);
/* Row n (0..15) of the column group at w (its columns of cols elements) decoded into
 * dst[0..cols); any run of a group's columns is a group of fewer columns. */
typedef void (*lm_deq_r16_fn)(const void *w, int64_t cols, int n, float *dst);
/* The 16 rows of the column group at w (cols elements each) into a k-major panel: element k
 * of row n at a[k * lda + n], with deq_r16's values. */
typedef void (*lm_panel_r16_fn)(const void *w, int64_t cols, float *a, int64_t lda);
/* The mr rows of tile (row i at tile + i * cols) into the k-major panel a[k * mr + i]. */
typedef void (*lm_panel_fn)(const float *tile, int64_t cols, float *a);
/* c[t * mr + r] = sum_k a[k * mr + r] * b[k * nr + t] for the ISA's (mr, nr) tile. */
typedef void (*lm_gemm_fn)(const float *a, const float *b, int64_t k, float *c);

typedef struct {
    lm_dequant_fn dequant[LM_NTYPES];
    lm_dot_fn dot[LM_NTYPES];
    lm_dotn_fn dotn[LM_NTYPES]; /* NULL: one dot per token */
    lm_quant_x16_fn quant_x16;
    lm_quads_x16_fn quads_x16; /* NULL: the integer products read lm_xq.q only */
    lm_bytes_x16_fn bytes_x16; /* NULL: no kernel reads lm_xq.b */
    lm_dotq_fn dotq[LM_NTYPES]; /* NULL: the type has no integer path (f32 products) */
    lm_dotq_r16_fn dotq_r16[LM_NTYPES]; /* by interleaved type (lm_r16_type) */
    lm_deq_r16_fn deq_r16[LM_NTYPES];
    lm_panel_r16_fn panel_r16[LM_NTYPES]; /* NULL: rows through deq_r16, then transposed */
    lm_panel_fn panel; /* NULL: the portable transposition */
    /* dst[i * nr + j] = src[j * ld + i] for i < n and j < rows, 0 for rows <= j < nr: rows
     * (at most nr) of n values into the GEMM's token panel; NULL: the callers' loops */
    void (*pack_nr)(const float *src, int64_t ld, int rows, int64_t n, float *dst);
    int r16_tokens;  /* most tokens per dotq_r16 call */
    int r16_fast;    /* 1: these kernels read the interleaved layouts faster than GGML's */
    /* 1: products of LM_GEMM_MIN_TOKENS and more tokens of the interleaved types run on the
     * integer kernels under int16 prefill (the same bits as a token alone); 0: the f32 GEMM */
    int r16_prefill;
    lm_gemm_fn gemm;
    int mr; /* weight rows per GEMM tile */
    int nr; /* tokens per GEMM tile */
    float (*dot_f32)(const float *a, const float *b, int64_t n);
    void (*axpy_f32)(float *y, float a, const float *x, int64_t n); /* y += a * x */
    /* In one pass, each step as scale_f32 and axpy_f32 compute it: y *= a, then z += b * y
     * (scale_axpy_f32); y += a * x, then z += b * y (axpy2_f32). */
    void (*scale_axpy_f32)(float *y, float a, float b, float *z, int64_t n);
    void (*axpy2_f32)(float *y, float a, const float *x, float b, float *z, int64_t n);
    void (*scale_f32)(float *y, float a, int64_t n);                /* y *= a */
    /* y *= a (each y[i] * a, rounded once), and the largest of the new y (NaNs skipped;
     * -inf when there is none) */
    float (*scale_max)(float *y, float a, int64_t n);
    /* x[i] = exp(x[i] - mx) (exactly 0 far below mx); returns the sum */
    float (*exp_sum)(float *x, int64_t n, float mx);
    void (*silu_mul)(float *out, const float *gate, const float *up, int64_t n);
    void (*gelu_mul)(float *out, const float *gate, const float *up, int64_t n);
    /* attention rows over j < n and hd elements: s[j] = scale * dot(q, k + j * ks), returning
     * the largest s[j]; out = sum_j p[j] * (v + j * vs) */
    float (*qk_scores)(const float *q, const float *k, int64_t ks, int64_t n, int hd,
                       float scale, float *s);
    void (*pv_sum)(const float *p, const float *v, int64_t vs, int64_t n, int hd, float *out);
    /* the same over f16 K / V rows, with the same float operations: rows widened to f32
     * first give the same bits */
    float (*qk_scores_f16)(const float *q, const uint16_t *k, int64_t ks, int64_t n, int hd,
                           float scale, float *s);
    void (*pv_sum_f16)(const float *p, const uint16_t *v, int64_t vs, int64_t n, int hd,
                       float *out);
    /* the same for nq queries over the same rows (f16 ones when `half`): query i reads q[i]
     * (p[i]) and writes s[i] and mx[i] (out[i]), with the bits it gets alone; NULL in tables
     * that have none (attention then runs the queries one by one) */
    void (*qk_scores_n)(const float *const *q, int nq, const void *k, int half, int64_t ks,
                        int64_t n, int hd, float scale, float *const *s, float *mx);
    void (*pv_sum_n)(const float *const *p, int nq, const void *v, int half, int64_t vs,
                     int64_t n, int hd, float *const *out);
    /* y[0..n) = x rounded to half (nearest even); and back, exactly */
    void (*f32_to_f16)(const float *x, uint16_t *y, int64_t n);
    void (*f16_to_f32)(const uint16_t *x, float *y, int64_t n);
} lm_kernels;

void lm_kernels_portable(lm_kernels *k);
/* The portable integer path (dotq.c), part of the portable table. */
void lm_kernels_portable_i16(lm_kernels *k);
/* The portable products and decoders of the interleaved layouts (rows16.c): the reference. */
void lm_kernels_portable_r16(lm_kernels *k);
#if LM_HAVE_X86
void lm_kernels_avx2(lm_kernels *k);
void lm_kernels_avx512(lm_kernels *k);
/* Factors of row n of a r16_q4_K column: f[j] = d * scale_j, m[j] = dmin * min_j (rows16.c). */
void lm_r16_factors_q4_K(const void *col, int n, float f[8], float m[8]);
/* The VNNI products of the interleaved layouts (simd_r16.c), part of the AVX-512 table. */
void lm_kernels_r16_avx512(lm_kernels *k);
/* The interleaved layouts' products of r16_kernels.h on AVX2 (simd_r16_avx2.c). */
void r16_kernels_avx2(lm_kernels *k);
#endif

#if LM_HAVE_NEON
/* The interleaved layouts' products of r16_kernels.h on NEON (simd_r16_neon.c). */
void r16_kernels_dotprod(lm_kernels *k);
void r16_kernels_i8mm(lm_kernels *k);
#endif

/* The table of the active ISA; never NULL. */
const lm_kernels *lm_kernels_active(void);

/* Return from the enclosing function when a call fails. */
#define LM_TRY(call)                                                                               \
    do {                                                                                           \
        const int lm_rc_ = (call);                                                                 \
        if (lm_rc_ != LM_OK) return lm_rc_;                                                        \
    } while (0)

/* ------------------------------------------------------------------ matmul internals */
/* Below this many tokens the fused per-row dot products (each block decoded once for up to
 * 8 tokens) beat decode + pack + GEMM. */
#define LM_GEMM_MIN_TOKENS 32
/* Products of at least LM_GEMM_MIN_TOKENS tokens (1 to 4 of them) sharing one input x and
 * its columns, in one packing of x and one dispatch (matmul.c). */
int lm_matmul_group(lm_pool *pool, const lm_mm *mms, int n, int64_t ntok);
_Static_assert(LM_DECODE_MAX_ROWS < LM_GEMM_MIN_TOKENS,
               "decode's rows must stay on the few-token products");

/* Rows [r0, r1) of y (ntok, rows) = x (ntok, cols) . w^T on the calling thread (dot path);
 * with xq (x quantized by lm_quantize_acts) the integer products. */
void lm_matmul_dot_rows(const lm_kernels *k, int type, const uint8_t *w, int64_t r0, int64_t r1,
                        int64_t rows, int64_t cols, const float *x, const lm_xq *xq,
                        int64_t ntok, float *y);

/* 1 when the ISA has an integer kernel for `type` weights (the dot path uses it while the
 * precision selected is LM_DECODE_I16; read that once per product). */
int lm_dot_has_i16(const lm_kernels *k, int type);
/* 1 when a product of ntok tokens of this type runs on int16 activations: under int16 decode
 * every type with integer products below LM_GEMM_MIN_TOKENS; under int16 prefill the
 * interleaved types from there on (the others take the f32 GEMM). */
int lm_int_products(const lm_kernels *k, int type, int64_t ntok);
/* The same under the given precisions (read once by a caller that asks more than once). */
int lm_int_products_at(const lm_kernels *k, int type, int64_t ntok, int decode, int prefill);
/* Bytes lm_quantize_acts needs for ntok x cols activations (cols a multiple of 32). */
size_t lm_xq_bytes(int64_t ntok, int64_t cols);
/* Quantize x (ntok, cols) into mem (lm_xq_bytes, 64-byte aligned) described by *xq. */
void lm_quantize_acts(const lm_kernels *k, const float *x, int64_t ntok, int64_t cols, void *mem,
                      lm_xq *xq);
/* The two halves of lm_quantize_acts: *xq pointed into mem (the quads only below
 * LM_GEMM_MIN_TOKENS), then tokens [t0, t1) of x quantized into it. */
void lm_xq_layout(const lm_kernels *k, int64_t ntok, int64_t cols, void *mem, lm_xq *xq);
void lm_xq_fill(const lm_kernels *k, const float *x, int64_t t0, int64_t t1, lm_xq *xq);
/* lm_quantize_acts on the acquired pool (or inline when NULL), tokens split between tasks. */
void lm_quantize_acts_on(lm_pool *acquired, const lm_kernels *k, const float *x, int64_t ntok,
                         int64_t cols, void *mem, lm_xq *xq);

/* ------------------------------------------------------------------ cache internals */
/* 1 when the cache was made for this geometry. */
int lm_cache_matches(const lm_cache *cache, int n_layer, const lm_cache_layer *layers);
/* After a chunk that ends at `end` but not the pass: a snapshot planned there is the live
 * state (the mixers keep only those strictly inside their rows). */
void lm_cache_snapshot_seam(lm_cache *cache, int64_t end);

/* ------------------------------------------------------------------ DeltaNet internals */
/* The cache geometry of a DeltaNet layer: no rows, its state. */
lm_cache_layer lm_deltanet_geometry(const lm_deltanet *d);
/* LM_OK when d's sizes, pointers and matrices fit the base (and, for a layer of the base, its
 * cache geometry). */
int lm_deltanet_check(const lm_base *b, const lm_deltanet *d, int layer);

/* ------------------------------------------------------------------ attention internals */
/* lm_attention over K and V rows of kv_type (LM_F32 / LM_F16), row stride kv_stride elements;
 * ring > 0: the rows are a ring, position p in row p % ring. */
int lm_attention_typed(lm_pool *pool, const float *q, const void *k, const void *v, int kv_type,
                       int64_t kv_stride, int64_t ring, float *out, int64_t ntok, int64_t pos0, int n_head,
                       int n_kv_head, int head_dim, float scale, int64_t window, float softcap);
/* lm_attention_typed; bidir: every query sees every key of the chunk and the window before its
 * first position (a block-diffusion canvas), not only the keys up to its own position. */
int lm_attention_span(lm_pool *pool, const float *q, const void *k, const void *v, int kv_type,
                      int64_t kv_stride, int64_t ring, float *out, int64_t ntok, int64_t pos0,
                      int n_head, int n_kv_head, int head_dim, float scale, int64_t window,
                      float softcap, int bidir);

/* lm_attention_typed with an additive bias by distance: bias (ntok, n_head, bias_extent) adds
 * bias[t, h, d] to the scaled score of query (t, h) and the key d positions before it, for
 * d < bias_extent (before the softcap); farther keys take none. bias NULL with extent 0:
 * none. */
int lm_attention_typed_bias(lm_pool *pool, const float *q, const void *k, const void *v,
                            int kv_type, int64_t kv_stride, int64_t ring, float *out,
                            int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                            float scale, int64_t window, float softcap, const float *bias,
                            int64_t bias_extent);

/* ------------------------------------------------------------------ pool internals */
/* Try to take exclusive use of the pool (its workers and scratch). 1 on success. */
int lm_pool_acquire(lm_pool *pool);
void lm_pool_release(lm_pool *pool);
/* A job of n_tasks tasks: fn(ctx, task, n_tasks, thread) runs once per task, on whichever
 * thread claims it; thread (< lm_pool_size) indexes per-thread scratch. */
typedef void (*lm_job_fn)(void *ctx, int task, int n_tasks, int thread);
/* Run a job on an acquired pool (n_tasks <= 65535) and return when every task is done. */
void lm_pool_run_tasks(lm_pool *pool, lm_job_fn fn, void *ctx, int n_tasks);
/* Scratch memory owned by an acquired pool, 64-byte aligned, valid until release. */
void *lm_pool_scratch(lm_pool *pool, size_t bytes);

/* 64-byte aligned allocation for callers without a pool. */
void *lm_aligned_alloc(size_t bytes);
void lm_aligned_free(void *p);

#endif /* LMSERVE_INTERNAL_H */
