/*
 * Interleaved layouts (enum lm_r16_type): Q4_0, Q4_1 and Q8_0 matrices with 16 rows stored
 * block column by block column (lmserve/types.h).
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

int lm_repack_r16(int from, const void *src, int to, void *dst, int64_t rows, int64_t cols) {
    if (lm_r16_base(to) != from || (from != LM_Q4_0 && from != LM_Q4_1 && from != LM_Q8_0)) {
        return LM_ETYPE;
    }
    const int64_t rb = lm_row_bytes(from, cols);
    if (src == NULL || dst == NULL || rows < 0 || rows % R16 != 0 || rb < 0) {
        return LM_EINVAL;
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
    if (!lm_kernels_active()->r16_fast) {
        return 0;
    }
    switch (type) {
    case LM_Q4_0:
        return LM_Q4_0_R16;
    case LM_Q4_1:
        return LM_Q4_1_R16;
    case LM_Q8_0:
        return LM_Q8_0_R16;
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

void lm_kernels_portable_r16(lm_kernels *k) {
#define SET_R16(name, type, col_t, mins)                                                           \
    k->dotq_r16[type] = p_dotq_r16_##name;                                                         \
    k->deq_r16[type] = p_deq_r16_##name;
    R16_TYPES(SET_R16)
#undef SET_R16
    k->r16_tokens = LM_DOTQ_TOKENS;
    k->r16_fast = 0;
}
#undef R16_TYPES
