/*
 * Tensor types: block geometry, and the portable (reference) decoders and dot products.
 * Every SIMD path must agree with these.
 */
#include <math.h>

#include "lm_internal.h"

/* ------------------------------------------------------------------ geometry */
int64_t lm_type_block_elems(int type) {
    switch (type) {
    case LM_F32:
    case LM_F16:
    case LM_BF16:
        return 1;
    case LM_Q4_0:
    case LM_Q4_1:
    case LM_Q5_0:
    case LM_Q5_1:
    case LM_Q8_0:
    case LM_Q4_0_R16:
    case LM_Q4_1_R16:
    case LM_Q8_0_R16:
        return QK; /* an interleaved row has the bytes of its GGML type's row */
    case LM_Q4_K:
    case LM_Q5_K:
    case LM_Q6_K:
    case LM_Q4_K_R16:
    case LM_Q6_K_R16:
        return QKK;
    case LM_Q2_0:
        return QK2;
    case LM_Q2_0_128:
        return QK2L;
    default:
        return 0;
    }
}

int64_t lm_type_block_bytes(int type) {
    switch (type) {
    case LM_F32:
        return 4;
    case LM_F16:
    case LM_BF16:
        return 2;
    case LM_Q4_0:
    case LM_Q4_0_R16:
        return sizeof(block_q4_0);
    case LM_Q4_1:
    case LM_Q4_1_R16:
        return sizeof(block_q4_1);
    case LM_Q5_0:
        return sizeof(block_q5_0);
    case LM_Q5_1:
        return sizeof(block_q5_1);
    case LM_Q8_0:
    case LM_Q8_0_R16:
        return sizeof(block_q8_0);
    case LM_Q4_K:
    case LM_Q4_K_R16:
        return sizeof(block_q4_K);
    case LM_Q5_K:
        return sizeof(block_q5_K);
    case LM_Q6_K:
    case LM_Q6_K_R16:
        return sizeof(block_q6_K);
    case LM_Q2_0:
        return sizeof(block_q2_0);
    case LM_Q2_0_128:
        return sizeof(block_q2_0_128);
    default:
        return 0;
    }
}

int64_t lm_row_bytes(int type, int64_t n) {
    int64_t be = lm_type_block_elems(type);
    if (be <= 0 || n < 0 || n % be != 0) {
        return -1;
    }
    int64_t nb = n / be;
    int64_t bb = lm_type_block_bytes(type);
    if (nb > INT64_MAX / bb) {
        return -1;
    }
    return nb * bb;
}

/* ------------------------------------------------------------------ portable decoders
 * Each decodes whole blocks with the same float operation order as GGML's reference
 * (and gguf-py's numpy): scale products first, then q * scale (- or + min). */
static void p_deq_f32(const void *src, float *dst, int64_t n) {
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void p_deq_f16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = lm_f16(p + 2 * i);
    }
}

static void p_deq_bf16(const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = lm_bf16_to_float(lm_load_half(p + 2 * i));
    }
}

static void p_deq_block_q4_0(const block_q4_0 *b, float *y) {
    const float d = lm_f16(&b->d);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)((b->qs[j] & 0xF) - 8) * d;
        y[j + QK / 2] = (float)((b->qs[j] >> 4) - 8) * d;
    }
}

static void p_deq_block_q4_1(const block_q4_1 *b, float *y) {
    const float d = lm_f16(&b->d);
    const float m = lm_f16(&b->m);
    for (int j = 0; j < QK / 2; j++) {
        y[j] = (float)(b->qs[j] & 0xF) * d + m;
        y[j + QK / 2] = (float)(b->qs[j] >> 4) * d + m;
    }
}

static void p_deq_block_q5_0(const block_q5_0 *b, float *y) {
    const float d = lm_f16(&b->d);
    uint32_t qh;
    memcpy(&qh, b->qh, sizeof qh);
    for (int j = 0; j < QK / 2; j++) {
        int h0 = (int)((qh >> j) & 1u) << 4;
        int h1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)(((b->qs[j] & 0xF) | h0) - 16) * d;
        y[j + QK / 2] = (float)(((b->qs[j] >> 4) | h1) - 16) * d;
    }
}

static void p_deq_block_q5_1(const block_q5_1 *b, float *y) {
    const float d = lm_f16(&b->d);
    const float m = lm_f16(&b->m);
    uint32_t qh;
    memcpy(&qh, b->qh, sizeof qh);
    for (int j = 0; j < QK / 2; j++) {
        int h0 = (int)((qh >> j) & 1u) << 4;
        int h1 = (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)((b->qs[j] & 0xF) | h0) * d + m;
        y[j + QK / 2] = (float)((b->qs[j] >> 4) | h1) * d + m;
    }
}

static void p_deq_block_q8_0(const block_q8_0 *b, float *y) {
    const float d = lm_f16(&b->d);
    for (int j = 0; j < QK; j++) {
        y[j] = (float)b->qs[j] * d;
    }
}

static void p_deq_block_q4_K(const block_q4_K *b, float *y) {
    const float d = lm_f16(&b->d);
    const float dmin = lm_f16(&b->dmin);
    const uint8_t *q = b->qs;
    for (int j = 0; j < 4; j++) {
        uint8_t sc, m;
        lm_scale_min_k4(2 * j, b->scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        lm_scale_min_k4(2 * j + 1, b->scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            y[l] = d1 * (float)(q[l] & 0xF) - m1;
            y[l + 32] = d2 * (float)(q[l] >> 4) - m2;
        }
        q += 32;
        y += 64;
    }
}

static void p_deq_block_q5_K(const block_q5_K *b, float *y) {
    const float d = lm_f16(&b->d);
    const float dmin = lm_f16(&b->dmin);
    const uint8_t *ql = b->qs;
    for (int j = 0; j < 4; j++) {
        uint8_t sc, m;
        lm_scale_min_k4(2 * j, b->scales, &sc, &m);
        const float d1 = d * (float)sc, m1 = dmin * (float)m;
        lm_scale_min_k4(2 * j + 1, b->scales, &sc, &m);
        const float d2 = d * (float)sc, m2 = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int h0 = ((b->qh[l] >> (2 * j)) & 1) << 4;
            int h1 = ((b->qh[l] >> (2 * j + 1)) & 1) << 4;
            y[l] = d1 * (float)((ql[l] & 0xF) | h0) - m1;
            y[l + 32] = d2 * (float)((ql[l] >> 4) | h1) - m2;
        }
        ql += 32;
        y += 64;
    }
}

static void p_deq_block_q6_K(const block_q6_K *b, float *y) {
    const float d = lm_f16(&b->d);
    const uint8_t *ql = b->ql;
    const uint8_t *qh = b->qh;
    const int8_t *sc = b->scales;
    for (int n = 0; n < 2; n++) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
            int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * (float)sc[is]) * (float)q1;
            y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
}

/* (code - 1) * d, as llama.cpp's dequantize_row_q2_0: exact (a product by -1, 0, 1 or 2) */
static void p_deq_block_q2_0(const block_q2_0 *b, float *y) {
    const float d = lm_f16(&b->d);
    for (int j = 0; j < QK2; j++) {
        y[j] = (float)(lm_q2_code(b->qs, j) - 1) * d;
    }
}

static void p_deq_block_q2_0_128(const block_q2_0_128 *b, float *y) {
    const float d = lm_f16(&b->d);
    for (int j = 0; j < QK2L; j++) {
        y[j] = (float)(lm_q2_code(b->qs, j) - 1) * d;
    }
}

#define DEF_DEQ(name, blk, qk)                                                                     \
    static void p_deq_##name(const void *src, float *dst, int64_t n) {                             \
        const blk *b = src;                                                                        \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            p_deq_block_##name(b + i, dst + i * (qk));                                             \
        }                                                                                          \
    }

#define DEF_DEQ_X(name, type, blk, qk) DEF_DEQ(name, blk, qk)
LM_BLOCK_TYPES(DEF_DEQ_X)
#undef DEF_DEQ_X

/* ------------------------------------------------------------------ portable dot products
 * Decode a block, then accumulate in 8 float lanes (the same shape a SIMD path has). */
static inline void p_acc8(float acc[8], const float *w, const float *x, int n) {
    for (int i = 0; i < n; i += 8) {
        for (int l = 0; l < 8; l++) {
            acc[l] += w[i + l] * x[i + l];
        }
    }
}

static inline float p_sum8(const float acc[8]) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static float p_dot_f32(const float *a, const float *b, int64_t n) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        p_acc8(acc, a + i, b + i, 8);
    }
    float s = p_sum8(acc);
    for (; i < n; i++) {
        s += a[i] * b[i];
    }
    return s;
}

static float p_dot_row_f32(const void *row, const float *x, int64_t n) {
    return p_dot_f32(row, x, n);
}

#define DEF_DOT_SCALAR(name, conv)                                                                 \
    static float p_dot_##name(const void *row, const float *x, int64_t n) {                        \
        const uint8_t *p = row;                                                                    \
        float acc[8] = {0};                                                                        \
        float w[8];                                                                                \
        int64_t i = 0;                                                                             \
        for (; i + 8 <= n; i += 8) {                                                               \
            for (int l = 0; l < 8; l++) {                                                          \
                w[l] = conv(lm_load_half(p + 2 * (i + l)));                                        \
            }                                                                                      \
            p_acc8(acc, w, x + i, 8);                                                              \
        }                                                                                          \
        float s = p_sum8(acc);                                                                     \
        for (; i < n; i++) {                                                                       \
            s += conv(lm_load_half(p + 2 * i)) * x[i];                                             \
        }                                                                                          \
        return s;                                                                                  \
    }

DEF_DOT_SCALAR(f16, lm_half_to_float)
DEF_DOT_SCALAR(bf16, lm_bf16_to_float)

#define DEF_DOT_BLOCK(name, blk, qk)                                                               \
    static float p_dot_##name(const void *row, const float *x, int64_t n) {                        \
        const blk *b = row;                                                                        \
        float acc[8] = {0};                                                                        \
        float w[qk];                                                                               \
        for (int64_t i = 0; i < n / (qk); i++) {                                                   \
            p_deq_block_##name(b + i, w);                                                          \
            p_acc8(acc, w, x + i * (qk), (qk));                                                    \
        }                                                                                          \
        return p_sum8(acc);                                                                        \
    }

#define DEF_DOT_X(name, type, blk, qk) DEF_DOT_BLOCK(name, blk, qk)
LM_BLOCK_TYPES(DEF_DOT_X)
#undef DEF_DOT_X

/* ------------------------------------------------------------------ portable f32 helpers */
static void p_axpy_f32(float *y, float a, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] += a * x[i];
    }
}

static void p_scale_axpy_f32(float *y, float a, float b, float *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] *= a;
        z[i] += b * y[i];
    }
}

static void p_axpy2_f32(float *y, float a, const float *x, float b, float *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] += a * x[i];
        z[i] += b * y[i];
    }
}

static void p_scale_f32(float *y, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] *= a;
    }
}

static float p_scale_max(float *y, float a, int64_t n) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        y[i] *= a;
        mx = y[i] > mx ? y[i] : mx;
    }
    return mx;
}

static float p_exp_sum(float *x, int64_t n, float mx) {
    float acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int l = 0; l < 8; l++) {
            x[i + l] = expf(x[i + l] - mx);
            acc[l] += x[i + l];
        }
    }
    float s = p_sum8(acc);
    for (; i < n; i++) {
        x[i] = expf(x[i] - mx);
        s += x[i];
    }
    return s;
}

static void p_silu_mul(float *out, const float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        out[i] = g * up[i] / (1.0f + expf(-g));
    }
}

/* gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)), u = sqrt(2/pi) (g + 0.044715 g^3) */
static void p_gelu_mul(float *out, const float *gate, const float *up, int64_t n) {
    const float c = 0.7978845608028654f;
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        const float u = c * (g + 0.044715f * g * g * g);
        out[i] = g * up[i] / (1.0f + expf(-2.0f * u));
    }
}

static float p_qk_scores(const float *q, const float *k, int64_t ks, int64_t n, int hd,
                         float scale, float *s) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        s[j] = p_dot_f32(q, k + j * ks, hd) * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

static void p_pv_sum(const float *p, const float *v, int64_t vs, int64_t n, int hd, float *out) {
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        p_axpy_f32(out, p[j], v + j * vs, hd);
    }
}

static void p_f32_to_f16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = lm_float_to_half(x[i]);
    }
}

static void p_f16_to_f32(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = lm_f16(x + i);
    }
}

/* f16 rows: the f32 operations on the exactly widened values, so both give the same bits. */
static float p_dot_kv_f16(const float *a, const uint16_t *b, int64_t n) {
    float acc[8] = {0}, t[8];
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        p_f16_to_f32(b + i, t, 8);
        p_acc8(acc, a + i, t, 8);
    }
    float s = p_sum8(acc);
    for (; i < n; i++) {
        s += a[i] * lm_f16(b + i);
    }
    return s;
}

static float p_qk_scores_f16(const float *q, const uint16_t *k, int64_t ks, int64_t n, int hd,
                             float scale, float *s) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        s[j] = p_dot_kv_f16(q, k + j * ks, hd) * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

static void p_pv_sum_f16(const float *p, const uint16_t *v, int64_t vs, int64_t n, int hd,
                         float *out) {
    memset(out, 0, (size_t)hd * sizeof(float));
    for (int64_t j = 0; j < n; j++) {
        for (int d = 0; d < hd; d++) {
            out[d] += p[j] * lm_f16(v + j * vs + d);
        }
    }
}

/* 8 weight rows x 4 tokens; the compiler keeps the 32 accumulators in vector registers. */
#define P_MR 8
#define P_NR 4

static void p_gemm_portable(const float *a, const float *b, int64_t k, float *c) {
    float acc[P_NR][P_MR] = {{0}};
    for (int64_t p = 0; p < k; p++) {
        const float *ap = a + p * P_MR;
        const float *bp = b + p * P_NR;
        for (int t = 0; t < P_NR; t++) {
            for (int r = 0; r < P_MR; r++) {
                acc[t][r] += ap[r] * bp[t];
            }
        }
    }
    memcpy(c, acc, sizeof acc);
}

void lm_kernels_portable(lm_kernels *k) {
    memset(k, 0, sizeof *k);
    k->dequant[LM_F32] = p_deq_f32;
    k->dequant[LM_F16] = p_deq_f16;
    k->dequant[LM_BF16] = p_deq_bf16;
    k->dot[LM_F32] = p_dot_row_f32;
    k->dot[LM_F16] = p_dot_f16;
    k->dot[LM_BF16] = p_dot_bf16;
#define SET_BLOCK(name, type, blk, qk)                                                             \
    k->dequant[type] = p_deq_##name;                                                               \
    k->dot[type] = p_dot_##name;
    LM_BLOCK_TYPES(SET_BLOCK)
#undef SET_BLOCK
    k->gemm = p_gemm_portable;
    k->mr = P_MR;
    k->nr = P_NR;
    k->dot_f32 = p_dot_f32;
    k->axpy_f32 = p_axpy_f32;
    k->scale_axpy_f32 = p_scale_axpy_f32;
    k->axpy2_f32 = p_axpy2_f32;
    k->scale_f32 = p_scale_f32;
    k->scale_max = p_scale_max;
    k->exp_sum = p_exp_sum;
    k->silu_mul = p_silu_mul;
    k->gelu_mul = p_gelu_mul;
    k->qk_scores = p_qk_scores;
    k->pv_sum = p_pv_sum;
    k->qk_scores_f16 = p_qk_scores_f16;
    k->pv_sum_f16 = p_pv_sum_f16;
    k->f32_to_f16 = p_f32_to_f16;
    k->f16_to_f32 = p_f16_to_f32;
    lm_kernels_portable_i16(k);
    lm_kernels_portable_r16(k);
}

#undef P_MR
#undef P_NR
#undef DEF_DEQ
#undef DEF_DOT_SCALAR
#undef DEF_DOT_BLOCK
