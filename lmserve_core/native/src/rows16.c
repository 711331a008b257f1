/*
 * Interleaved layouts (enum lm_r16_type): Q4_0, Q4_1, Q8_0, Q4_K and Q6_K matrices with 16
 * rows stored block column by block column (lmserve/types.h).
 *
 * A product then reads 16 rows at a time with the rows in the vector lanes: a block's
 * integer sums of 16 rows land in one vector with no horizontal reduction, and the factors
 * are applied to 16 outputs per instruction (simd_r16.c). Every kernel applies them in the
 * order the portable products here do, so each output has the same bits on every path and
 * for any number of tokens.
 *
 * Here: the repacking (lm_repack_r16), the portable products and decoders (the reference),
 * and the choice of layout (lm_r16_for).
 */
#include <math.h>

#include "lm_internal.h"

/* ------------------------------------------------------------------ repacking */
/* Integer j (0..31) of a GGML block, as the signed value its products multiply. */
static int q_of_q4_0(const void *blk, int j) {
    const block_q4_0 *b = blk;
    return (j < 16 ? (b->qs[j] & 0x0F) : (b->qs[j - 16] >> 4)) - 8;
}

static int q_of_q4_1(const void *blk, int j) {
    const block_q4_1 *b = blk;
    return j < 16 ? (b->qs[j] & 0x0F) : (b->qs[j - 16] >> 4);
}

static int q_of_q8_0(const void *blk, int j) {
    return ((const block_q8_0 *)blk)->qs[j];
}

/* Store q (Q4_0: q + 8, Q4_1: q, both 0..15) as tile byte p of row R of a Q4 column. */
static void put_nibble(uint8_t *qs, int R, int p, int q) {
    int shift;
    const int at = lm_r16_nibble_at(R, p, &shift);
    qs[at] = (uint8_t)((qs[at] & ~(0x0F << shift)) | ((q & 0x0F) << shift));
}

/* Element e (0..255) of a Q4_K super-block: its nibble, and of a Q6_K one: its 6 bits
 * (the value plus 32), as types.c's decoders read them. */
static int u_of_q4_K(const block_q4_K *b, int e) {
    const uint8_t *q = b->qs + 32 * (e / 64);
    return e % 64 < 32 ? (q[e % 32] & 0x0F) : (q[e % 32] >> 4);
}

static int u_of_q6_K(const block_q6_K *b, int e) {
    const int h = e / 128, k = e % 128 / 32, l = e % 32;
    const uint8_t ql = b->ql[64 * h + l + 32 * (k & 1)], qh = b->qh[32 * h + l];
    return ((k < 2 ? ql & 0x0F : ql >> 4) | (((qh >> (2 * k)) & 3) << 4));
}

/* The 4 nibbles u[0..3] of row n in tile row R (tile bytes 4n .. 4n + 3): two packed bytes
 * (lm_r16_nibble_at of p = 4n + j is 2 (n % 4) + j / 2 past the pair's first byte). */
static void put_quad(uint8_t *qs, int R, int n, const int u[4]) {
    uint8_t *at = qs + 64 * (R / 2) + 16 * (n / 4) + 8 * (R & 1) + 2 * (n % 4);
    at[0] = (uint8_t)((u[0] & 0x0F) | (u[1] & 0x0F) << 4);
    at[1] = (uint8_t)((u[2] & 0x0F) | (u[3] & 0x0F) << 4);
}

/* Rows 16g .. 16g + 15 of a Q4_K / Q6_K matrix (nb super-blocks a row, rb bytes) into dst. */
static void repack_k(int from, const uint8_t *s, int64_t rb, int64_t nb, uint8_t *dst) {
    for (int64_t b = 0; b < nb; b++) {
        for (int n = 0; n < R16; n++) {
            const uint8_t *blk = s + n * rb + b * lm_type_block_bytes(from);
            int u[QKK];
            if (from == LM_Q4_K) {
                r16_q4_K *c = (r16_q4_K *)dst + b;
                const block_q4_K *q = (const block_q4_K *)blk;
                c->d[n] = q->d;
                c->dmin[n] = q->dmin;
                for (int w = 0; w < 3; w++) memcpy(&c->sc[w][n], q->scales + 4 * w, 4);
                for (int e = 0; e < QKK; e++) u[e] = u_of_q4_K(q, e);
                for (int R = 0; R < QKK / 4; R++) put_quad(c->qs, R, n, u + 4 * R);
            } else {
                r16_q6_K *c = (r16_q6_K *)dst + b;
                const block_q6_K *q = (const block_q6_K *)blk;
                c->d[n] = q->d;
                for (int i = 0; i < QKK / 16; i++) c->sc[i][n] = q->scales[i];
                for (int e = 0; e < QKK; e++) u[e] = u_of_q6_K(q, e);
                for (int R = 0; R < QKK / 4; R++) put_quad(c->ql, R, n, u + 4 * R);
                for (int i = 0; i < QKK / 16; i++) {
                    for (int j = 0; j < 4; j++) {
                        int h = 0;
                        for (int t = 0; t < 4; t++) h |= (u[16 * i + 4 * t + j] >> 4) << (2 * t);
                        c->qh[i][4 * n + j] = (uint8_t)h;
                    }
                }
            }
        }
    }
}

int lm_repack_r16(int from, const void *src, int to, void *dst, int64_t rows, int64_t cols) {
    if (lm_r16_base(to) != from || lm_r16_base(to) < 0) {
        return LM_ETYPE;
    }
    const int64_t rb = lm_row_bytes(from, cols);
    if (src == NULL || dst == NULL || rows < 0 || rows % R16 != 0 || rb < 0) {
        return LM_EINVAL;
    }
    if (from == LM_Q4_K || from == LM_Q6_K) {
        for (int64_t g = 0; g < rows / R16; g++) {
            repack_k(from, (const uint8_t *)src + g * R16 * rb, rb, cols / QKK,
                     (uint8_t *)dst + g * R16 * rb);
        }
        return LM_OK;
    }
    const int64_t nb = cols / QK, bb = lm_type_block_bytes(from);
    const uint8_t *s = src;
    for (int64_t g = 0; g < rows / R16; g++) {
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *col = (uint8_t *)dst + (g * nb + b) * R16 * bb;
            memset(col, 0, (size_t)(R16 * bb));
            for (int n = 0; n < R16; n++) {
                const uint8_t *blk = s + (g * R16 + n) * rb + b * bb;
                for (int j = 0; j < QK; j++) {
                    const int R = j / 4, p = 4 * n + j % 4;
                    if (from == LM_Q8_0) {
                        r16_q8_0 *c = (r16_q8_0 *)col;
                        c->d[n] = lm_load_half(blk);
                        c->qs[64 * R + p] = (int8_t)q_of_q8_0(blk, j);
                    } else if (from == LM_Q4_0) {
                        r16_q4_0 *c = (r16_q4_0 *)col;
                        c->d[n] = lm_load_half(blk);
                        put_nibble(c->qs, R, p, q_of_q4_0(blk, j) + 8);
                    } else {
                        r16_q4_1 *c = (r16_q4_1 *)col;
                        const block_q4_1 *q = (const block_q4_1 *)blk;
                        c->d[n] = q->d;
                        c->m[n] = q->m;
                        put_nibble(c->qs, R, p, q_of_q4_1(blk, j));
                    }
                }
            }
        }
    }
    return LM_OK;
}

int lm_r16_for(int type) {
    const lm_kernels *k = lm_kernels_active();
    if (!k->r16_fast) {
        return 0;
    }
    switch (type) {
    case LM_Q4_0:
        return LM_Q4_0_R16;
    case LM_Q4_1:
        return LM_Q4_1_R16;
    case LM_Q8_0:
        return LM_Q8_0_R16;
    /* the super-blocks only where the GEMM reads their panels directly: a row's portable
     * decoding would cost prefill more than the products gain */
    case LM_Q4_K:
        return k->panel_r16[LM_Q4_K_R16] != NULL ? LM_Q4_K_R16 : 0;
    case LM_Q6_K:
        return k->panel_r16[LM_Q6_K_R16] != NULL ? LM_Q6_K_R16 : 0;
    default:
        return 0;
    }
}

/* ------------------------------------------------------------------ portable kernels */
/* The integer of tile byte p of row R of a column (the value its products multiply). */
static int p_r16_q4_0(const void *col, int R, int p) {
    int shift;
    const int at = lm_r16_nibble_at(R, p, &shift);
    return ((((const r16_q4_0 *)col)->qs[at] >> shift) & 0x0F) - 8;
}

static int p_r16_q4_1(const void *col, int R, int p) {
    int shift;
    const int at = lm_r16_nibble_at(R, p, &shift);
    return (((const r16_q4_1 *)col)->qs[at] >> shift) & 0x0F;
}

static int p_r16_q8_0(const void *col, int R, int p) {
    return ((const r16_q8_0 *)col)->qs[64 * R + p];
}

/* float factor (and min, 0 when the type has none) of row n of a column */
static float p_r16_f_q4_0(const void *col, int n, float *m) {
    *m = 0.0f;
    return lm_f16(&((const r16_q4_0 *)col)->d[n]);
}

static float p_r16_f_q4_1(const void *col, int n, float *m) {
    *m = lm_f16(&((const r16_q4_1 *)col)->m[n]);
    return lm_f16(&((const r16_q4_1 *)col)->d[n]);
}

static float p_r16_f_q8_0(const void *col, int n, float *m) {
    *m = 0.0f;
    return lm_f16(&((const r16_q8_0 *)col)->d[n]);
}

#define R16_TYPES(X)                                                                               \
    X(q4_0, LM_Q4_0_R16, r16_q4_0, 0)                                                              \
    X(q4_1, LM_Q4_1_R16, r16_q4_1, 1)                                                              \
    X(q8_0, LM_Q8_0_R16, r16_q8_0, 0)

#define DEF_R16_PORTABLE(name, type, col_t, mins)                                                  \
    static void p_dotq_r16_##name(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,  \
                                  float *y, int64_t ldy) {                                         \
        const int64_t K = x->n, nb = K / QK;                                                       \
        const col_t *cols = w;                                                                     \
        for (int t = 0; t < nt; t++) {                                                             \
            const int16_t *xq = x->q + (t0 + t) * K;                                               \
            const float *ds = x->ds + (t0 + t) * (K / 16);                                         \
            for (int64_t g = 0; g < ng; g++) {                                                     \
                for (int n = 0; n < R16; n++) {                                                    \
                    float acc = 0.0f;                                                              \
                    for (int64_t b = 0; b < nb; b++) {                                             \
                        const col_t *c = cols + g * nb + b;                                        \
                        int32_t sum = 0;                                                           \
                        for (int j = 0; j < QK; j++)                                               \
                            sum += p_r16_##name(c, j / 4, 4 * n + j % 4) * xq[QK * b + j];        \
                        float m;                                                                   \
                        const float f = p_r16_f_##name(c, n, &m);                                  \
                        acc = fmaf((float)sum, f * ds[2 * b], acc);                                \
                        if (mins) acc = fmaf(m, ds[2 * b + 1], acc);                               \
                    }                                                                              \
                    y[t * ldy + g * R16 + n] = acc;                                                \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    static void p_deq_r16_##name(const void *w, int64_t cols, int n, float *dst) {                 \
        const col_t *c = w;                                                                        \
        for (int64_t b = 0; b < cols / QK; b++) {                                                  \
            float m;                                                                               \
            const float f = p_r16_f_##name(c + b, n, &m);                                          \
            for (int j = 0; j < QK; j++) {                                                         \
                const float q = (float)p_r16_##name(c + b, j / 4, 4 * n + j % 4);                  \
                dst[QK * b + j] = mins ? q * f + m : q * f;                                        \
            }                                                                                      \
        }                                                                                          \
    }
R16_TYPES(DEF_R16_PORTABLE)
#undef DEF_R16_PORTABLE

/* The super-blocks. Q4_K's sub-block j (elements 32j .. 32j + 31, one group of x) has the
 * factor d * scale_j and the min dmin * min_j, both exact in float: the sub-block's integer
 * sum is applied as a Q4_1 block's, acc = fma(sum, f * d, acc), then acc = fma(-m, s, acc).
 * Q6_K's sub-block i has 16 elements and the factor d * scale_i (exact): each half of a group
 * is applied on its own, acc = fma(sum, f * d, acc), with the group's step d. */
static int p_r16_nib(const uint8_t *qs, int R, int p) {
    int shift;
    const int at = lm_r16_nibble_at(R, p, &shift);
    return (qs[at] >> shift) & 0x0F;
}

/* factors of row n of a Q4_K column: f[j] = d * scale_j, m[j] = dmin * min_j */
void lm_r16_factors_q4_K(const void *col, int n, float f[8], float m[8]) {
    const r16_q4_K *c = col;
    uint8_t sc[12], u[16];
    for (int w = 0; w < 3; w++) memcpy(sc + 4 * w, &c->sc[w][n], 4);
    lm_kq_unpack(sc, u);
    const float d = lm_f16(&c->d[n]), dmin = lm_f16(&c->dmin[n]);
    for (int j = 0; j < 8; j++) {
        f[j] = d * (float)u[j];
        m[j] = dmin * (float)u[8 + j];
    }
}

static int p_r16_q6_K(const r16_q6_K *c, int R, int p) {
    return (p_r16_nib(c->ql, R, p) | (((c->qh[R / 4][p] >> (2 * (R % 4))) & 3) << 4)) - 32;
}

static void p_dotq_r16_q4_K(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,
                            float *y, int64_t ldy) {
    const int64_t K = x->n, nb = K / QKK;
    const r16_q4_K *cols = w;
    for (int t = 0; t < nt; t++) {
        const int16_t *xq = x->q + (t0 + t) * K;
        const float *ds = x->ds + (t0 + t) * (K / 16);
        for (int64_t g = 0; g < ng; g++) {
            for (int n = 0; n < R16; n++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const r16_q4_K *c = cols + g * nb + b;
                    float f[8], m[8];
                    lm_r16_factors_q4_K(c, n, f, m);
                    for (int j = 0; j < 8; j++) {
                        const int64_t G = 8 * b + j;
                        int32_t sum = 0;
                        for (int e = 32 * j; e < 32 * j + 32; e++)
                            sum += p_r16_nib(c->qs, e / 4, 4 * n + e % 4) * xq[QKK * b + e];
                        acc = fmaf((float)sum, f[j] * ds[2 * G], acc);
                        acc = fmaf(-m[j], ds[2 * G + 1], acc);
                    }
                }
                y[t * ldy + g * R16 + n] = acc;
            }
        }
    }
}

static void p_deq_r16_q4_K(const void *w, int64_t cols, int n, float *dst) {
    const r16_q4_K *c = w;
    for (int64_t b = 0; b < cols / QKK; b++) {
        float f[8], m[8];
        lm_r16_factors_q4_K(c + b, n, f, m);
        for (int e = 0; e < QKK; e++)
            dst[QKK * b + e] = f[e / 32] * (float)p_r16_nib(c[b].qs, e / 4, 4 * n + e % 4) -
                               m[e / 32];
    }
}

static void p_dotq_r16_q6_K(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt,
                            float *y, int64_t ldy) {
    const int64_t K = x->n, nb = K / QKK;
    const r16_q6_K *cols = w;
    for (int t = 0; t < nt; t++) {
        const int16_t *xq = x->q + (t0 + t) * K;
        const float *ds = x->ds + (t0 + t) * (K / 16);
        for (int64_t g = 0; g < ng; g++) {
            for (int n = 0; n < R16; n++) {
                float acc = 0.0f;
                for (int64_t b = 0; b < nb; b++) {
                    const r16_q6_K *c = cols + g * nb + b;
                    const float d = lm_f16(&c->d[n]);
                    for (int i = 0; i < QKK / 16; i++) {
                        const int64_t G = 8 * b + i / 2;
                        int32_t sum = 0;
                        for (int e = 16 * i; e < 16 * i + 16; e++)
                            sum += p_r16_q6_K(c, e / 4, 4 * n + e % 4) * xq[QKK * b + e];
                        acc = fmaf((float)sum, (d * (float)c->sc[i][n]) * ds[2 * G], acc);
                    }
                }
                y[t * ldy + g * R16 + n] = acc;
            }
        }
    }
}

static void p_deq_r16_q6_K(const void *w, int64_t cols, int n, float *dst) {
    const r16_q6_K *c = w;
    for (int64_t b = 0; b < cols / QKK; b++) {
        const float d = lm_f16(&c[b].d[n]);
        for (int e = 0; e < QKK; e++)
            dst[QKK * b + e] =
                (d * (float)c[b].sc[e / 16][n]) * (float)p_r16_q6_K(c + b, e / 4, 4 * n + e % 4);
    }
}

void lm_kernels_portable_r16(lm_kernels *k) {
    k->dotq_r16[LM_Q4_K_R16] = p_dotq_r16_q4_K;
    k->deq_r16[LM_Q4_K_R16] = p_deq_r16_q4_K;
    k->dotq_r16[LM_Q6_K_R16] = p_dotq_r16_q6_K;
    k->deq_r16[LM_Q6_K_R16] = p_deq_r16_q6_K;
#define SET_R16(name, type, col_t, mins)                                                           \
    k->dotq_r16[type] = p_dotq_r16_##name;                                                         \
    k->deq_r16[type] = p_deq_r16_##name;
    R16_TYPES(SET_R16)
#undef SET_R16
    k->r16_tokens = LM_DOTQ_TOKENS;
    k->r16_fast = 0;
    k->r16_prefill = 0;
}
#undef R16_TYPES
