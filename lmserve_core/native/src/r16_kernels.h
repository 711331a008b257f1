/*
 * The integer products of the interleaved layouts (rows16.c), written once over a vector
 * layer (vec_<isa>.h) and compiled once per ISA that includes this file after its layer.
 *
 * Sixteen rows are the unit: a tile row (16 rows x 4 elements) times a token's four
 * activations gives the 16 rows' int32 sums with no horizontal reduction, and a block's
 * factors apply to 16 outputs at once in the order the portable products apply them to
 * one, so every output has the portable kernels' bits, for any ISA and token count.
 *
 * Activations are int16 split into bytes (lm_bytes_x16_fn): x = 256 hi + lo, hi signed,
 * lo unsigned. The layer's dot_lo / dot_hi multiply a tile's weights by a token's four low
 * / high bytes, each ISA with the instruction it has (maddubs, dpbusd, sdot, udot, usdot).
 * A weight byte comes signed (ws, its integer) and unsigned (wu = ws + C, C the type's
 * offset); where the layer multiplies wu (V_LO_WU, V_HI_WU), the group's sum of x's bytes
 * takes C back out. From V_WORDS_FROM tokens a pass (and for Q8_0 where the layer cannot
 * multiply its bytes), each block's weights are widened to int16 once and every token of
 * the pass multiplies them in pairs (dot_words) instead. The integer sums are exact, so
 * none of this changes a bit.
 *
 * Defines VN(r16_kernels)(lm_kernels *), installing the products, the GEMM panels and
 * bytes_x16.
 */

/* ------------------------------------------------------------------ activations */
/* lm_bytes_x16_fn, with the groups' sums of the low bytes after those of the high ones */
VFN void VN(bytes_x16)(const int16_t *q, int64_t n, uint8_t *b) {
    int32_t *hsum = (int32_t *)(b + 2 * n), *lsum = hsum + n / 32;
    for (int64_t g = 0; g < n / 32; g++) {
        int32_t hs = 0, ls = 0;
        for (int i = 0; i < 32; i++) {
            const int16_t v = q[32 * g + i];
            const int32_t hi = v >> 8, lo = v & 255;
            b[32 * g + i] = (uint8_t)lo;
            b[n + 32 * g + i] = (uint8_t)hi;
            hs += hi;
            ls += lo;
        }
        hsum[g] = hs;
        lsum[g] = ls;
    }
}

/* A pass's view of its tokens' activations. */
typedef struct {
    const uint8_t *lo, *hi;
    const int32_t *hs, *ls; /* per group: sum of hi, sum of lo */
    const int16_t *q;
    const float *ds;
} VN(vtok);

VF VN(vtok) VN(tok_at)(const lm_xq *x, int64_t t) {
    const int64_t K = x->n;
    VN(vtok) v;
    v.q = x->q + t * K;
    v.ds = x->ds + t * (K / 16);
    v.lo = x->b != NULL ? x->b + t * LM_BYTE_COLS(K) : NULL;
    v.hi = v.lo != NULL ? v.lo + K : NULL;
    v.hs = v.lo != NULL ? (const int32_t *)(v.lo + 2 * K) : NULL;
    v.ls = v.hs != NULL ? v.hs + K / 32 : NULL;
    return v;
}

/* Every line of the column this far on: one thread's stream alone does not keep enough
 * reads in flight to approach the memory bandwidth. */
#ifndef LM_R16_AHEAD
#define LM_R16_AHEAD 8192
static inline void lm_r16_prefetch(const void *col, size_t bytes) {
    const char *at = (const char *)col + LM_R16_AHEAD / bytes * bytes;
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(at + off, 0, 3);
}
#endif

/* A token's four tile-row products, both bytes of x: elements e .. e + 7 against tile rows
 * (s0, u0) and (s1, u1). */
VF void VN(dot8)(VN(vrows) *l, VN(vrows) *h, VN(vtile) s0, VN(vtile) u0, VN(vtile) s1,
                 VN(vtile) u1, const VN(vtok) *x, int64_t e) {
    *l = VN(dot_lo)(*l, s0, u0, x->lo + e);
    *l = VN(dot_lo)(*l, s1, u1, x->lo + e + 4);
    *h = VN(dot_hi)(*h, s0, u0, x->hi + e);
    *h = VN(dot_hi)(*h, s1, u1, x->hi + e + 4);
}

/* The exact sum 256 h + l of a group g (32 elements) whose weights were offset by C. */
VF VN(vrows) VN(group_sum)(VN(vrows) l, VN(vrows) h, const VN(vtok) *x, int64_t g, int C) {
    if (C != 0 && V_HI_WU) h = VN(rows_add)(h, VN(rows_set1)(-C * x->hs[g]));
    if (C != 0 && V_LO_WU) l = VN(rows_add)(l, VN(rows_set1)(-C * x->ls[g]));
    return VN(rows_hi_lo)(h, l);
}

/* ------------------------------------------------------------------ blocks of 32 */
/* tile rows 2c, 2c + 1 of a column: s the weights' integers, u = s + C */
VF void VN(tiles_q4_0)(const void *col, int c, VN(vtile) s[2], VN(vtile) u[2]) {
    VN(tile_q4)(((const r16_q4_0 *)col)->qs, c, &u[0], &u[1]);
    s[0] = VN(tile_sub)(u[0], 8);
    s[1] = VN(tile_sub)(u[1], 8);
}

VF void VN(tiles_q4_1)(const void *col, int c, VN(vtile) s[2], VN(vtile) u[2]) {
    VN(tile_q4)(((const r16_q4_1 *)col)->qs, c, &s[0], &s[1]);
    u[0] = s[0];
    u[1] = s[1];
}

VF void VN(tiles_q8_0)(const void *col, int c, VN(vtile) s[2], VN(vtile) u[2]) {
    const int8_t *qs = ((const r16_q8_0 *)col)->qs + 128 * c;
    s[0] = VN(tile_load)(qs);
    s[1] = VN(tile_load)(qs + 64);
    u[0] = VN(tile_xor)(s[0], 0x80);
    u[1] = VN(tile_xor)(s[1], 0x80);
}

#define V_C_q4_0 8
#define V_C_q4_1 0
#define V_C_q8_0 128
#define V_MINS_q4_0 0
#define V_MINS_q4_1 1
#define V_MINS_q8_0 0
#define V_M_q4_0(c) ((c)->d)
#define V_M_q4_1(c) ((c)->m)
#define V_M_q8_0(c) ((c)->d)

/* A token's exact sum of n tile rows' words times its elements from q on. */
VF VN(vrows) VN(words_sum)(const VN(vwords) *wv, const int n, const int16_t *q) {
    VN(vpairs) p = VN(pairs_zero)();
    for (int k = 0; k < n; k++) {
        p = VN(dot_words)(p, &wv[k], q + 4 * k);
        VN(pairs_keep)(&p);
    }
    return VN(pairs_fold)(p);
}

/* isum[t] for nt tokens, two at a time (each word vector read once for both). */
VF void VN(words_sums)(const VN(vwords) *wv, const int n, const VN(vtok) *xt, int nt, int64_t e,
                       VN(vrows) *isum) {
    int t = 0;
    for (; t + 2 <= nt; t += 2) {
        VN(vpairs) p = VN(pairs_zero)(), r = VN(pairs_zero)();
        for (int k = 0; k < n; k++) {
            p = VN(dot_words)(p, &wv[k], xt[t].q + e + 4 * k);
            r = VN(dot_words)(r, &wv[k], xt[t + 1].q + e + 4 * k);
            VN(pairs_keep)(&p);
            VN(pairs_keep)(&r);
        }
        isum[t] = VN(pairs_fold)(p);
        isum[t + 1] = VN(pairs_fold)(r);
    }
    if (t < nt) isum[t] = VN(words_sum)(wv, n, xt[t].q + e);
}

#define DEF_V_APPLY(name, col_t)                                                                   \
    VF VN(vrowsf) VN(b32_apply_##name)(const col_t *c, VN(vrows) isum, const VN(vtok) *x,        \
                                       int64_t b, VN(vrowsf) acc) {                                \
        const VN(vrowsf) fd =                                                                      \
            VN(rowsf_mul)(VN(rowsf_half)(c->d), VN(rowsf_set1)(x->ds[2 * b]));                    \
        acc = VN(rowsf_fma)(VN(rowsf_cvt)(isum), fd, acc);                                         \
        if (V_MINS_##name)                                                                         \
            acc = VN(rowsf_fma)(VN(rowsf_half)(V_M_##name(c)), VN(rowsf_set1)(x->ds[2 * b + 1]),  \
                                acc);                                                              \
        return acc;                                                                                \
    }
DEF_V_APPLY(q4_0, r16_q4_0)
DEF_V_APPLY(q4_1, r16_q4_1)
DEF_V_APPLY(q8_0, r16_q8_0)
#undef DEF_V_APPLY

/* Per block: acc = fma(sum, f * d, acc), then acc = fma(m, s, acc) for a type with mins.
 * With `words` the weights are widened once for any nt (<= V_PASS_TOKENS) tokens, else NT
 * (<= V_TOKENS, nt == NT) tokens multiply the bytes. */
#define DEF_V_B32(name, col_t)                                                                     \
    VF void VN(b32_##name)(const col_t *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT,   \
                           const int words, int nt, float *y, int64_t ldy) {                       \
        const int64_t nb = x->n / 32;                                                              \
        VN(vtok) xt[V_PASS_TOKENS];                                                                \
        for (int t = 0; t < nt; t++) xt[t] = VN(tok_at)(x, t0 + t);                                \
        for (int64_t g = 0; g < ng; g++) {                                                         \
            VN(vrowsf) acc[V_PASS_TOKENS];                                                         \
            for (int t = 0; t < nt; t++) acc[t] = VN(rowsf_zero)();                                \
            for (int64_t b = 0; b < nb; b++) {                                                     \
                const col_t *c = w + g * nb + b;                                                   \
                lm_r16_prefetch(c, sizeof *c);                                                     \
                VN(vrows) isum[V_PASS_TOKENS];                                                     \
                if (words) {                                                                       \
                    VN(vwords) wv[8];                                                              \
                    for (int k = 0; k < 4; k++) {                                                  \
                        VN(vtile) s[2], u[2];                                                      \
                        VN(tiles_##name)(c, k, s, u);                                              \
                        wv[2 * k] = VN(widen)(s[0]);                                               \
                        wv[2 * k + 1] = VN(widen)(s[1]);                                           \
                    }                                                                              \
                    VN(words_sums)(wv, 8, xt, nt, 32 * b, isum);                                   \
                } else {                                                                           \
                    VN(vrows) l[V_TOKENS], h[V_TOKENS];                                            \
                    for (int t = 0; t < NT; t++) l[t] = h[t] = VN(rows_set1)(0);                   \
                    for (int k = 0; k < 4; k++) {                                                  \
                        VN(vtile) s[2], u[2];                                                      \
                        VN(tiles_##name)(c, k, s, u);                                              \
                        for (int t = 0; t < NT; t++)                                               \
                            VN(dot8)(&l[t], &h[t], s[0], u[0], s[1], u[1], &xt[t], 32 * b + 8 * k); \
                    }                                                                              \
                    for (int t = 0; t < NT; t++)                                                   \
                        isum[t] = VN(group_sum)(l[t], h[t], &xt[t], b, V_C_##name);                \
                }                                                                                  \
                for (int t = 0; t < nt; t++)                                                       \
                    acc[t] = VN(b32_apply_##name)(c, isum[t], &xt[t], b, acc[t]);                  \
            }                                                                                      \
            for (int t = 0; t < nt; t++) VN(rowsf_store)(y + t * ldy + 16 * g, acc[t]);            \
        }                                                                                          \
    }
DEF_V_B32(q4_0, r16_q4_0)
DEF_V_B32(q4_1, r16_q4_1)
DEF_V_B32(q8_0, r16_q8_0)
#undef DEF_V_B32

/* ------------------------------------------------------------------ super-blocks */
/* 16 rows' scale j (0..7) or min j (8..15) of a Q4_K column, times f: its words unpacked as
 * lm_kq_unpack does, o[0] scales 0..3, o[1] scales 4..7, o[2] mins 0..3, o[3] mins 4..7 */
VF void VN(q4K_unpack)(const r16_q4_K *c, VN(vrows) o[4]) {
    const VN(vrows) w0 = VN(rows_load)(c->sc[0]), w1 = VN(rows_load)(c->sc[1]);
    const VN(vrows) w2 = VN(rows_load)(c->sc[2]);
    o[0] = VN(rows_and)(w0, 0x3f3f3f3fu);
    o[1] = VN(rows_or)(VN(rows_and)(w2, 0x0f0f0f0fu),
                       VN(rows_sll)(VN(rows_and)(VN(rows_srl)(w0, 6), 0x03030303u), 4));
    o[2] = VN(rows_and)(w1, 0x3f3f3f3fu);
    o[3] = VN(rows_or)(VN(rows_and)(VN(rows_srl)(w2, 4), 0x0f0f0f0fu),
                       VN(rows_sll)(VN(rows_and)(VN(rows_srl)(w1, 6), 0x03030303u), 4));
}

VF VN(vrowsf) VN(q4K_factor)(const VN(vrows) o[4], int j, VN(vrowsf) f) {
    const VN(vrows) v = VN(rows_and)(VN(rows_srl)(o[j / 4], 8 * (j % 4)), 0xFFu);
    return VN(rowsf_mul)(f, VN(rowsf_cvt)(v));
}

/* Sub-block j (one group of x): acc = fma(sum, f_j * d, acc), then acc = fma(-m_j, s, acc).
 * With `words` the weights are widened once for any nt (<= V_PASS_TOKENS) tokens, else NT
 * (<= V_TOKENS, nt == NT) tokens multiply the bytes. */
VF void VN(q4K)(const r16_q4_K *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT,
                const int words, int nt, float *y, int64_t ldy) {
    const int64_t nb = x->n / QKK;
    VN(vtok) xt[V_PASS_TOKENS];
    for (int t = 0; t < nt; t++) xt[t] = VN(tok_at)(x, t0 + t);
    for (int64_t g = 0; g < ng; g++) {
        VN(vrowsf) acc[V_PASS_TOKENS];
        for (int t = 0; t < nt; t++) acc[t] = VN(rowsf_zero)();
        for (int64_t b = 0; b < nb; b++) {
            const r16_q4_K *c = w + g * nb + b;
            lm_r16_prefetch(c, sizeof *c);
            VN(vrows) o[4];
            VN(q4K_unpack)(c, o);
            const VN(vrowsf) d = VN(rowsf_half)(c->d), dm = VN(rowsf_half)(c->dmin);
            for (int j = 0; j < 8; j++) {
                const int64_t G = 8 * b + j, e = QKK * b + 32 * j;
                VN(vrows) isum[V_PASS_TOKENS];
                if (words) {
                    VN(vwords) wv[8];
                    for (int k = 0; k < 4; k++) {
                        VN(vtile) r0, r1;
                        VN(tile_q4)(c->qs + 256 * j, k, &r0, &r1);
                        wv[2 * k] = VN(widen)(r0);
                        wv[2 * k + 1] = VN(widen)(r1);
                    }
                    VN(words_sums)(wv, 8, xt, nt, e, isum);
                } else {
                    VN(vrows) l[V_TOKENS], h[V_TOKENS];
                    for (int t = 0; t < NT; t++) l[t] = h[t] = VN(rows_set1)(0);
                    for (int k = 0; k < 4; k++) {
                        VN(vtile) r0, r1;
                        VN(tile_q4)(c->qs + 256 * j, k, &r0, &r1);
                        for (int t = 0; t < NT; t++)
                            VN(dot8)(&l[t], &h[t], r0, r0, r1, r1, &xt[t], e + 8 * k);
                    }
                    for (int t = 0; t < NT; t++)
                        isum[t] = VN(group_sum)(l[t], h[t], &xt[t], G, 0);
                }
                const VN(vrowsf) f = VN(q4K_factor)(o, j, d), m = VN(q4K_factor)(o, 8 + j, dm);
                for (int t = 0; t < nt; t++) {
                    const VN(vrowsf) fd = VN(rowsf_mul)(f, VN(rowsf_set1)(xt[t].ds[2 * G]));
                    acc[t] = VN(rowsf_fma)(VN(rowsf_cvt)(isum[t]), fd, acc[t]);
                    acc[t] = VN(rowsf_fnma)(m, VN(rowsf_set1)(xt[t].ds[2 * G + 1]), acc[t]);
                }
            }
        }
        for (int t = 0; t < nt; t++) VN(rowsf_store)(y + t * ldy + 16 * g, acc[t]);
    }
}

/* tile rows 4i + 2h, 4i + 2h + 1 of a Q6_K column as their 6-bit values u = q + 32 */
VF void VN(tiles_q6_K)(const r16_q6_K *c, VN(vtile) qh, int i, int h, VN(vtile) *u0,
                       VN(vtile) *u1) {
    VN(tile_q4)(c->ql, 2 * i + h, u0, u1);
    const VN(vtile) a = h ? qh : VN(tile_sll16)(qh, 4);
    const VN(vtile) b = h ? VN(tile_srl16)(qh, 2) : VN(tile_sll16)(qh, 2);
    *u0 = VN(tile_or_and)(*u0, a, 0x30);
    *u1 = VN(tile_or_and)(*u1, b, 0x30);
}

/* Sub-block i (16 elements, half a group of x): the products of u, less 32 times the
 * sub-block's sum of x (xs; words multiply q = u - 32 instead), then
 * acc = fma(sum, (d * scale_i) * step, acc). Words and bytes as VN(q4K). */
VF void VN(q6K)(const r16_q6_K *w, int64_t ng, const lm_xq *x, int64_t t0, const int NT,
                const int words, int nt, float *y, int64_t ldy, const int32_t *xs) {
    const int64_t K = x->n, nb = K / QKK;
    VN(vtok) xt[V_PASS_TOKENS];
    for (int t = 0; t < nt; t++) xt[t] = VN(tok_at)(x, t0 + t);
    for (int64_t g = 0; g < ng; g++) {
        VN(vrowsf) acc[V_PASS_TOKENS];
        for (int t = 0; t < nt; t++) acc[t] = VN(rowsf_zero)();
        for (int64_t b = 0; b < nb; b++) {
            const r16_q6_K *c = w + g * nb + b;
            lm_r16_prefetch(c, sizeof *c);
            const VN(vrowsf) d = VN(rowsf_half)(c->d);
            for (int i = 0; i < QKK / 16; i++) {
                const VN(vtile) qh = VN(tile_load)(c->qh[i]);
                const int64_t G = 8 * b + i / 2, e = QKK * b + 16 * i;
                VN(vrows) isum[V_PASS_TOKENS];
                if (words) { /* the words hold q = u - 32 itself */
                    VN(vwords) wv[4];
                    for (int hh = 0; hh < 2; hh++) {
                        VN(vtile) u0, u1;
                        VN(tiles_q6_K)(c, qh, i, hh, &u0, &u1);
                        wv[2 * hh] = VN(widen)(VN(tile_sub)(u0, 32));
                        wv[2 * hh + 1] = VN(widen)(VN(tile_sub)(u1, 32));
                    }
                    VN(words_sums)(wv, 4, xt, nt, e, isum);
                } else {
                    VN(vrows) l[V_TOKENS], h[V_TOKENS];
                    for (int t = 0; t < NT; t++) {
                        l[t] = VN(rows_set1)(xs[t * (K / 16) + 16 * b + i]);
                        h[t] = VN(rows_set1)(0);
                    }
                    for (int hh = 0; hh < 2; hh++) {
                        VN(vtile) u0, u1;
                        VN(tiles_q6_K)(c, qh, i, hh, &u0, &u1);
                        for (int t = 0; t < NT; t++)
                            VN(dot8)(&l[t], &h[t], u0, u0, u1, u1, &xt[t], e + 8 * hh);
                    }
                    for (int t = 0; t < NT; t++) isum[t] = VN(rows_hi_lo)(h[t], l[t]);
                }
                const VN(vrowsf) f = VN(rowsf_mul)(d, VN(rowsf_i8)(c->sc[i]));
                for (int t = 0; t < nt; t++) {
                    const VN(vrowsf) fd = VN(rowsf_mul)(f, VN(rowsf_set1)(xt[t].ds[2 * G]));
                    acc[t] = VN(rowsf_fma)(VN(rowsf_cvt)(isum[t]), fd, acc[t]);
                }
            }
        }
        for (int t = 0; t < nt; t++) VN(rowsf_store)(y + t * ldy + 16 * g, acc[t]);
    }
}

/* ------------------------------------------------------------------ entry points
 * nt (<= V_PASS_TOKENS) tokens: in one pass of words from V_WORDS_FROM tokens (always for
 * Q8_0 where the layer cannot multiply its bytes), else in passes of V_TOKENS of bytes. */
#define V_NT_SWITCH(call)                                                                          \
    switch (nt) {                                                                                  \
    case 1: call(1); break;                                                                        \
    case 2: call(2); break;                                                                        \
    case 3: call(3); break;                                                                        \
    default: call(4); break;                                                                       \
    }
_Static_assert(V_TOKENS == 4, "V_NT_SWITCH covers four tokens a pass");

#define DEF_V_ENTRY_B32(name, words_always)                                                        \
    VFN void VN(dotq_r16_##name)(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt0,  \
                                 float *y, int64_t ldy) {                                          \
        if ((words_always) || nt0 >= V_WORDS_FROM) {                                               \
            VN(b32_##name)(w, ng, x, t0, 1, 1, nt0, y, ldy);                                       \
            return;                                                                                \
        }                                                                                          \
        for (int p = 0; p < nt0; p += V_TOKENS) {                                                  \
            const int nt = nt0 - p < V_TOKENS ? nt0 - p : V_TOKENS;                                \
            V_NT_SWITCH(V_CALL_B32_##name)                                                         \
        }                                                                                          \
    }
#define V_CALL_B32_q4_0(NT) VN(b32_q4_0)(w, ng, x, t0 + p, NT, 0, NT, y + p * ldy, ldy)
#define V_CALL_B32_q4_1(NT) VN(b32_q4_1)(w, ng, x, t0 + p, NT, 0, NT, y + p * ldy, ldy)
#define V_CALL_B32_q8_0(NT) VN(b32_q8_0)(w, ng, x, t0 + p, NT, 0, NT, y + p * ldy, ldy)
DEF_V_ENTRY_B32(q4_0, 0)
DEF_V_ENTRY_B32(q4_1, 0)
DEF_V_ENTRY_B32(q8_0, !V_BYTES_Q8)

VFN void VN(dotq_r16_q4_K)(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt0,
                           float *y, int64_t ldy) {
    if (nt0 >= V_WORDS_FROM) {
        VN(q4K)(w, ng, x, t0, 1, 1, nt0, y, ldy);
        return;
    }
    for (int p = 0; p < nt0; p += V_TOKENS) {
        const int nt = nt0 - p < V_TOKENS ? nt0 - p : V_TOKENS;
#define V_CALL(NT) VN(q4K)(w, ng, x, t0 + p, NT, 0, NT, y + p * ldy, ldy)
        V_NT_SWITCH(V_CALL)
#undef V_CALL
    }
}

/* Q6_K: words multiply q itself; bytes multiply u = q + 32, so -32 times each token's sum of
 * x over each sub-block of 16 first (32 KiB of them on the stack, more on the heap) */
VFN void VN(dotq_r16_q6_K)(const void *w, int64_t ng, const lm_xq *x, int64_t t0, int nt0,
                           float *y, int64_t ldy) {
    if (nt0 >= V_WORDS_FROM) {
        VN(q6K)(w, ng, x, t0, 1, 1, nt0, y, ldy, NULL);
        return;
    }
    const int64_t K = x->n;
    int32_t stack[V_TOKENS * 2048];
    int32_t *xs = (size_t)(nt0 * (K / 16)) <= sizeof stack / sizeof *stack
                      ? stack
                      : malloc((size_t)(nt0 * (K / 16)) * sizeof(int32_t));
    if (xs == NULL) {
        for (int t = 0; t < nt0; t++)
            for (int64_t r = 0; r < 16 * ng; r++) y[t * ldy + r] = NAN;
        return;
    }
    for (int t = 0; t < nt0; t++) {
        const int16_t *q = x->q + (t0 + t) * K;
        for (int64_t i = 0; i < K / 16; i++) {
            int32_t sum = 0;
            for (int e = 0; e < 16; e++) sum += q[16 * i + e];
            xs[t * (K / 16) + i] = -32 * sum;
        }
    }
    for (int p = 0; p < nt0; p += V_TOKENS) {
        const int nt = nt0 - p < V_TOKENS ? nt0 - p : V_TOKENS;
#define V_CALL(NT) VN(q6K)(w, ng, x, t0 + p, NT, 0, NT, y + p * ldy, ldy, xs + p * (K / 16))
        V_NT_SWITCH(V_CALL)
#undef V_CALL
    }
    if (xs != stack) free(xs);
}

/* ------------------------------------------------------------------ GEMM panels
 * The 16 rows of a column group into the f32 GEMM's k-major panel (element k of row n at
 * a[k * lda + n]) with deq_r16's values: q * f, + m (mins > 0) or - m (mins < 0). */
VF void VN(panel_put)(VN(vtile) t, VN(vrowsf) f, VN(vrowsf) m, const int mins, float *at,
                      int64_t lda) {
    const VN(vrows) v = VN(rows_of_tile)(t);
    for (int j = 0; j < 4; j++) {
        VN(vrowsf) q = VN(rowsf_mul)(VN(rowsf_cvt)(VN(rows_byte)(v, j)), f);
        if (mins > 0) q = VN(rowsf_add)(q, m);
        if (mins < 0) q = VN(rowsf_sub)(q, m);
        VN(rowsf_store)(at + j * lda, q);
    }
}

#define DEF_V_PANEL(name, col_t)                                                                   \
    VFN void VN(panel_r16_##name)(const void *w, int64_t cols, float *a, int64_t lda) {           \
        const col_t *col = w;                                                                      \
        for (int64_t b = 0; b < cols / 32; b++) {                                                  \
            const col_t *c = col + b;                                                              \
            const VN(vrowsf) f = VN(rowsf_half)(c->d), m = VN(rowsf_half)(V_M_##name(c));          \
            for (int k = 0; k < 4; k++) {                                                          \
                VN(vtile) s[2], u[2];                                                              \
                VN(tiles_##name)(c, k, s, u);                                                      \
                VN(panel_put)(s[0], f, m, V_MINS_##name, a + (32 * b + 8 * k) * lda, lda);         \
                VN(panel_put)(s[1], f, m, V_MINS_##name, a + (32 * b + 8 * k + 4) * lda, lda);     \
            }                                                                                      \
        }                                                                                          \
    }
DEF_V_PANEL(q4_0, r16_q4_0)
DEF_V_PANEL(q4_1, r16_q4_1)
DEF_V_PANEL(q8_0, r16_q8_0)
#undef DEF_V_PANEL

VFN void VN(panel_r16_q4_K)(const void *w, int64_t cols, float *a, int64_t lda) {
    const r16_q4_K *col = w;
    for (int64_t b = 0; b < cols / QKK; b++) {
        const r16_q4_K *c = col + b;
        VN(vrows) o[4];
        VN(q4K_unpack)(c, o);
        const VN(vrowsf) d = VN(rowsf_half)(c->d), dm = VN(rowsf_half)(c->dmin);
        for (int j = 0; j < 8; j++) {
            const VN(vrowsf) f = VN(q4K_factor)(o, j, d), m = VN(q4K_factor)(o, 8 + j, dm);
            for (int k = 0; k < 4; k++) {
                VN(vtile) r0, r1;
                VN(tile_q4)(c->qs + 256 * j, k, &r0, &r1);
                float *at = a + (QKK * b + 32 * j + 8 * k) * lda;
                VN(panel_put)(r0, f, m, -1, at, lda);
                VN(panel_put)(r1, f, m, -1, at + 4 * lda, lda);
            }
        }
    }
}

VFN void VN(panel_r16_q6_K)(const void *w, int64_t cols, float *a, int64_t lda) {
    const r16_q6_K *col = w;
    for (int64_t b = 0; b < cols / QKK; b++) {
        const r16_q6_K *c = col + b;
        const VN(vrowsf) d = VN(rowsf_half)(c->d);
        for (int i = 0; i < QKK / 16; i++) {
            const VN(vtile) qh = VN(tile_load)(c->qh[i]);
            const VN(vrowsf) f = VN(rowsf_mul)(d, VN(rowsf_i8)(c->sc[i]));
            for (int hh = 0; hh < 2; hh++) {
                VN(vtile) u0, u1;
                VN(tiles_q6_K)(c, qh, i, hh, &u0, &u1);
                float *at = a + (QKK * b + 16 * i + 8 * hh) * lda;
                VN(panel_put)(VN(tile_sub)(u0, 32), f, f, 0, at, lda);
                VN(panel_put)(VN(tile_sub)(u1, 32), f, f, 0, at + 4 * lda, lda);
            }
        }
    }
}

void VN(r16_kernels)(lm_kernels *k) {
    k->dotq_r16[LM_Q4_0_R16] = VN(dotq_r16_q4_0);
    k->dotq_r16[LM_Q4_1_R16] = VN(dotq_r16_q4_1);
    k->dotq_r16[LM_Q8_0_R16] = VN(dotq_r16_q8_0);
    k->dotq_r16[LM_Q4_K_R16] = VN(dotq_r16_q4_K);
    k->dotq_r16[LM_Q6_K_R16] = VN(dotq_r16_q6_K);
    k->panel_r16[LM_Q4_0_R16] = VN(panel_r16_q4_0);
    k->panel_r16[LM_Q4_1_R16] = VN(panel_r16_q4_1);
    k->panel_r16[LM_Q8_0_R16] = VN(panel_r16_q8_0);
    k->panel_r16[LM_Q4_K_R16] = VN(panel_r16_q4_K);
    k->panel_r16[LM_Q6_K_R16] = VN(panel_r16_q6_K);
    k->bytes_x16 = VN(bytes_x16);
    k->r16_tokens = V_PASS_TOKENS;
    k->r16_fast = 1;
    k->r16_prefill = V_INT_PREFILL;
}

#undef V_NT_SWITCH
#undef DEF_V_ENTRY_B32
#undef V_CALL_B32_q4_0
#undef V_CALL_B32_q4_1
#undef V_CALL_B32_q8_0
#undef V_C_q4_0
#undef V_C_q4_1
#undef V_C_q8_0
#undef V_MINS_q4_0
#undef V_MINS_q4_1
#undef V_MINS_q8_0
#undef V_M_q4_0
#undef V_M_q4_1
#undef V_M_q8_0
