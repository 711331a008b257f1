/*
 * Integer products of the few-token matmuls: activations quantized to int16 per group of 32,
 * multiplied with the weights' integers; the group's float factors are applied to the
 * integer sums. The portable kernels here are the reference every SIMD path must agree with.
 *
 * For a group of 32 weights w = f * q + m (q the block's integers, f its scale, m its offset:
 * 0 for Q4_0 / Q5_0 / Q8_0 / Q6_K / Q2_0, the min otherwise) and activations x ~= d * xq:
 *     sum w * x  ~=  f * d * sum(q * xq) + m * sum(x)
 * The integer sum is exact; sum(x) is the group's f32 sum. Q6_K has a scale per 16 weights.
 */
#include <math.h>
#include <stdatomic.h>

#include "lm_internal.h"

static _Atomic int g_precision = LM_DECODE_I16;

int lm_decode_precision_active(void) {
    return atomic_load_explicit(&g_precision, memory_order_relaxed);
}

int lm_decode_precision_select(int precision) {
    if (precision != LM_DECODE_F32 && precision != LM_DECODE_I16) return LM_EINVAL;
    atomic_store(&g_precision, precision);
    return LM_OK;
}

static _Atomic int g_prefill = LM_PREFILL_I16;

int lm_prefill_precision_active(void) {
    return atomic_load_explicit(&g_prefill, memory_order_relaxed);
}

int lm_prefill_precision_select(int precision) {
    if (precision != LM_PREFILL_F32 && precision != LM_PREFILL_I16) return LM_EINVAL;
    atomic_store(&g_prefill, precision);
    return LM_OK;
}

int lm_dot_has_i16(const lm_kernels *k, int type) {
    if (type < 0 || type >= LM_NTYPES || k->quant_x16 == NULL) return 0;
    return k->dotq[type] != NULL || k->dotq_r16[type] != NULL;
}

int lm_int_products_at(const lm_kernels *k, int type, int64_t ntok, int decode, int prefill) {
    if (ntok < LM_GEMM_MIN_TOKENS) return decode == LM_DECODE_I16 && lm_dot_has_i16(k, type);
    return prefill == LM_PREFILL_I16 && k->r16_prefill && lm_r16_base(type) >= 0 &&
           k->dotq_r16[type] != NULL && k->quant_x16 != NULL;
}

int lm_int_products(const lm_kernels *k, int type, int64_t ntok) {
    return lm_int_products_at(k, type, ntok, lm_decode_precision_active(),
                              lm_prefill_precision_active());
}

int lm_int_products_active(int type, int64_t ntok) {
    return ntok > 0 && lm_int_products(lm_kernels_active(), type, ntok);
}

/* ------------------------------------------------------------------ activations */
static void p_quant_x16(const float *x, int64_t n, int16_t *q, float *ds) {
    for (int64_t g = 0; g < n / 32; g++) {
        const float *xg = x + 32 * g;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++) {
            amax = fmaxf(amax, fabsf(xg[i]));
            sum += xg[i];
        }
        int16_t *qg = q + 32 * g;
        if (!isfinite(sum) || !isfinite(amax)) {
            ds[2 * g] = ds[2 * g + 1] = NAN;
            memset(qg, 0, 32 * sizeof *qg);
            continue;
        }
        const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < 32; i++) qg[i] = (int16_t)nearbyintf(xg[i] * inv);
        ds[2 * g] = amax / 32767.0f;
        ds[2 * g + 1] = sum;
    }
}

static size_t xq_q_bytes(int64_t ntok, int64_t cols) {
    return ((size_t)(ntok * cols) * sizeof(int16_t) + 63) & ~(size_t)63;
}

static size_t xq_b_bytes(int64_t ntok, int64_t cols) {
    return ((size_t)(ntok * LM_BYTE_COLS(cols)) + 63) & ~(size_t)63;
}

/* room for the quads and the bytes too, whichever table quantizes: they are a few KiB */
size_t lm_xq_bytes(int64_t ntok, int64_t cols) {
    return xq_q_bytes(ntok, cols) + xq_q_bytes(ntok, LM_QUAD_COLS(cols)) +
           xq_b_bytes(ntok, cols) + (size_t)(ntok * (cols / 16)) * sizeof(float);
}

void lm_xq_layout(const lm_kernels *k, int64_t ntok, int64_t cols, void *mem, lm_xq *xq) {
    uint8_t *m = mem;
    xq->q = (int16_t *)m;
    const size_t at_q4 = xq_q_bytes(ntok, cols);
    const size_t at_b = at_q4 + xq_q_bytes(ntok, LM_QUAD_COLS(cols));
    /* the quads serve the few-token products of the file's layouts only */
    xq->q4 = ntok < LM_GEMM_MIN_TOKENS && k->quads_x16 != NULL ? (int16_t *)(m + at_q4) : NULL;
    xq->b = k->bytes_x16 != NULL ? m + at_b : NULL;
    xq->ds = (float *)(m + at_b + xq_b_bytes(ntok, cols));
    xq->n = cols;
}

void lm_xq_fill(const lm_kernels *k, const float *x, int64_t t0, int64_t t1, lm_xq *xq) {
    const int64_t cols = xq->n;
    for (int64_t t = t0; t < t1; t++) {
        k->quant_x16(x + t * cols, cols, xq->q + t * cols, xq->ds + t * (cols / 16));
        if (xq->q4 != NULL) k->quads_x16(xq->q + t * cols, cols, xq->q4 + t * LM_QUAD_COLS(cols));
        if (xq->b != NULL) k->bytes_x16(xq->q + t * cols, cols, xq->b + t * LM_BYTE_COLS(cols));
    }
}

void lm_quantize_acts(const lm_kernels *k, const float *x, int64_t ntok, int64_t cols, void *mem,
                      lm_xq *xq) {
    lm_xq_layout(k, ntok, cols, mem, xq);
    lm_xq_fill(k, x, 0, ntok, xq);
}

/* ------------------------------------------------------------------ weight integers
 * p_ints_<type>(b, g, s, q, f, m): group g of block b as integers q[32] with factors f[0]
 * (elements 0..15) and f[1] (16..31) and offset *m; s holds lm_scales_<type>(b). */
static void p_ints_q4_0(const block_q4_0 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    (void)g;
    for (int i = 0; i < 16; i++) {
        q[i] = (b->qs[i] & 0x0F) - 8;
        q[i + 16] = (b->qs[i] >> 4) - 8;
    }
    f[0] = f[1] = s[0];
    *m = 0.0f;
}

static void p_ints_q4_1(const block_q4_1 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    (void)g;
    for (int i = 0; i < 16; i++) {
        q[i] = b->qs[i] & 0x0F;
        q[i + 16] = b->qs[i] >> 4;
    }
    f[0] = f[1] = s[0];
    *m = s[1];
}

static int p_q5_high(const uint8_t *qh, int i) {
    uint32_t h;
    memcpy(&h, qh, sizeof h);
    return (int)((h >> i) & 1u) << 4;
}

static void p_ints_q5_0(const block_q5_0 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    (void)g;
    for (int i = 0; i < 16; i++) {
        q[i] = ((b->qs[i] & 0x0F) | p_q5_high(b->qh, i)) - 16;
        q[i + 16] = ((b->qs[i] >> 4) | p_q5_high(b->qh, i + 16)) - 16;
    }
    f[0] = f[1] = s[0];
    *m = 0.0f;
}

static void p_ints_q5_1(const block_q5_1 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    (void)g;
    for (int i = 0; i < 16; i++) {
        q[i] = (b->qs[i] & 0x0F) | p_q5_high(b->qh, i);
        q[i + 16] = (b->qs[i] >> 4) | p_q5_high(b->qh, i + 16);
    }
    f[0] = f[1] = s[0];
    *m = s[1];
}

static void p_ints_q8_0(const block_q8_0 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    (void)g;
    for (int i = 0; i < 32; i++) q[i] = b->qs[i];
    f[0] = f[1] = s[0];
    *m = 0.0f;
}

static void p_ints_q4_K(const block_q4_K *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    const uint8_t *qs = b->qs + 32 * (g / 2);
    for (int i = 0; i < 32; i++) q[i] = (qs[i] >> (4 * (g & 1))) & 0x0F;
    f[0] = f[1] = s[g];
    *m = -s[8 + g];
}

static void p_ints_q5_K(const block_q5_K *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    const uint8_t *qs = b->qs + 32 * (g / 2);
    for (int i = 0; i < 32; i++)
        q[i] = ((qs[i] >> (4 * (g & 1))) & 0x0F) | (((b->qh[i] >> g) & 1) << 4);
    f[0] = f[1] = s[g];
    *m = -s[8 + g];
}

static void p_ints_q6_K(const block_q6_K *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    const int n = g / 4, gg = g % 4;
    const uint8_t *ql = b->ql + 64 * n + 32 * (gg & 1);
    const uint8_t *qh = b->qh + 32 * n;
    for (int i = 0; i < 32; i++)
        q[i] = (((ql[i] >> (4 * (gg >> 1))) & 0x0F) | (((qh[i] >> (2 * gg)) & 3) << 4)) - 32;
    f[0] = s[8 * n + 2 * gg];
    f[1] = s[8 * n + 2 * gg + 1];
    *m = 0.0f;
}

/* Q2_0 / Q2_0_128: group g is the codes of bytes qs[8 g .. 8 g + 8), each minus 1. */
static void p_ints_q2(const uint8_t *qs, int g, const float *s, int q[32], float f[2],
                      float *m) {
    for (int i = 0; i < 32; i++) q[i] = lm_q2_code(qs, 32 * g + i) - 1;
    f[0] = f[1] = s[0];
    *m = 0.0f;
}

static void p_ints_q2_0(const block_q2_0 *b, int g, const float *s, int q[32], float f[2],
                        float *m) {
    p_ints_q2(b->qs, g, s, q, f, m);
}

static void p_ints_q2_0_128(const block_q2_0_128 *b, int g, const float *s, int q[32],
                            float f[2], float *m) {
    p_ints_q2(b->qs, g, s, q, f, m);
}

#define DEF_DOTQ_PORTABLE(name, type, blk, qk)                                                     \
    static void p_dotq_##name(const void *row, const lm_xq *x, int64_t t0, int nt, float *out,    \
                              int64_t ldo) {                                                       \
        const blk *b = row;                                                                        \
        const int64_t n = x->n;                                                                    \
        for (int t = 0; t < nt; t++) {                                                             \
            const int16_t *xq = x->q + (t0 + t) * n;                                               \
            const float *ds = x->ds + (t0 + t) * (n / 16);                                         \
            float acc = 0.0f, offs = 0.0f, s[16], f[2], m;                                         \
            int q[32];                                                                             \
            for (int64_t i = 0; i < n / (qk); i++) {                                               \
                lm_scales_##name(b + i, s);                                                        \
                for (int g = 0; g < (qk) / 32; g++) {                                              \
                    const int64_t G = i * ((qk) / 32) + g;                                         \
                    p_ints_##name(b + i, g, s, q, f, &m);                                          \
                    int32_t lo = 0, hi = 0;                                                        \
                    for (int e = 0; e < 16; e++) {                                                 \
                        lo += q[e] * xq[32 * G + e];                                               \
                        hi += q[e + 16] * xq[32 * G + e + 16];                                     \
                    }                                                                              \
                    acc += f[0] * ds[2 * G] * (float)lo + f[1] * ds[2 * G] * (float)hi;            \
                    offs += m * ds[2 * G + 1];                                                     \
                }                                                                                  \
            }                                                                                      \
            out[t * ldo] = acc + offs;                                                             \
        }                                                                                          \
    }
LM_BLOCK_TYPES(DEF_DOTQ_PORTABLE)
#undef DEF_DOTQ_PORTABLE

void lm_kernels_portable_i16(lm_kernels *k) {
    k->quant_x16 = p_quant_x16;
#define SET_DOTQ(name, type, blk, qk) k->dotq[type] = p_dotq_##name;
    LM_BLOCK_TYPES(SET_DOTQ)
#undef SET_DOTQ
}

/* ------------------------------------------------------------------ row entry points */
int lm_quantize_x16(const float *x, int64_t n, int16_t *q, float *ds) {
    if (n < 0 || n % 32 != 0 || (n > 0 && (x == NULL || q == NULL || ds == NULL)))
        return LM_EINVAL;
    if (n > 0) lm_kernels_active()->quant_x16(x, n, q, ds);
    return LM_OK;
}

int lm_vec_dot_i16(int type, const void *row, const float *x, int64_t n, float *out) {
    const lm_kernels *k = lm_kernels_active();
    if (lm_type_block_elems(type) <= 0) return LM_ETYPE;
    if (type < 0 || type >= LM_NTYPES || k->dotq[type] == NULL) return LM_ETYPE;
    if (row == NULL || x == NULL || out == NULL || lm_row_bytes(type, n) < 0) return LM_EINVAL;
    if (n == 0) {
        *out = 0.0f;
        return LM_OK;
    }
    void *mem = lm_aligned_alloc(lm_xq_bytes(1, n));
    if (mem == NULL) return LM_ENOMEM;
    lm_xq xq;
    lm_quantize_acts(k, x, 1, n, mem, &xq);
    k->dotq[type](row, &xq, 0, 1, out, 1);
    lm_aligned_free(mem);
    return LM_OK;
}
