/*
 * lmserve shared native kernels.
 *
 * One copy of the GGUF block formats, their dot products and GEMM, the small leaf ops of
 * a transformer forward pass, and a thread pool. The core builds them into its own cffi
 * module (lmserve_core._kernels) and every family plugin compiles them into its forward
 * pass module from lmserve_core.native.get_sources() / get_include().
 *
 * Conventions: functions return LM_OK (0) or a negative status; they never exit or print.
 * Sizes are int64_t element counts. Callers validate every pointer and size.
 */
#ifndef LMSERVE_KERNELS_H
#define LMSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------ status codes */
enum lm_status {
    LM_OK = 0,
    LM_EINVAL = -1, /* bad argument (size not a multiple of the block, NULL, ...) */
    LM_ENOMEM = -2,
    LM_ETYPE = -3,  /* tensor type not supported */
    LM_EISA = -4    /* instruction set not available on this CPU */
};

/* ------------------------------------------------------------------ tensor types
 * Values are GGML's type ids, so a GGUF tensor's type passes through unchanged. */
enum lm_type {
    LM_F32 = 0,
    LM_F16 = 1,
    LM_Q4_0 = 2,
    LM_Q4_1 = 3,
    LM_Q5_0 = 6,
    LM_Q5_1 = 7,
    LM_Q8_0 = 8,
    LM_Q4_K = 12,
    LM_Q5_K = 13,
    LM_Q6_K = 14,
    LM_BF16 = 30
};

int64_t lm_type_block_elems(int type); /* elements per block; <= 0: unknown type */
int64_t lm_type_block_bytes(int type); /* bytes per block;    <= 0: unknown type */
int64_t lm_row_bytes(int type, int64_t n); /* bytes of an n-element row; < 0 if invalid */

/* ------------------------------------------------------------------ ISA dispatch */
enum lm_isa { LM_ISA_PORTABLE = 0, LM_ISA_AVX2 = 1, LM_ISA_AVX512 = 2 };

int lm_isa_best(void);          /* the best ISA this CPU supports */
int lm_isa_active(void);        /* the ISA kernels currently use (default: best) */
int lm_isa_select(int isa);     /* LM_EISA if the CPU lacks it; process-wide */

/* ------------------------------------------------------------------ rows */
/* dst[0..n) = dequantized src row. */
int lm_dequantize_row(int type, const void *src, float *dst, int64_t n);
/* *out = dot(row (n elements of `type`), x (n floats)). */
int lm_vec_dot(int type, const void *row, const float *x, int64_t n, float *out);

/* ------------------------------------------------------------------ thread pool */
typedef struct lm_pool lm_pool;
typedef void (*lm_task_fn)(void *ctx, int ith, int nth);

lm_pool *lm_pool_new(int n_threads); /* n_threads <= 0: one per online core; NULL on failure */
void lm_pool_free(lm_pool *pool);
int lm_pool_size(const lm_pool *pool);
/* Run fn(ctx, ith, nth) for ith in [0, nth) on the pool (the caller runs ith 0) and
 * return when all are done. pool may be NULL: runs fn(ctx, 0, 1) inline. */
void lm_pool_run(lm_pool *pool, lm_task_fn fn, void *ctx);

/* ------------------------------------------------------------------ matmul
 * y[t * rows + r] = sum_c w[r][c] * x[t * cols + c]   for t < ntok, r < rows
 * w: rows x cols of `type`, row stride lm_row_bytes(type, cols); x: ntok x cols f32;
 * y: ntok x rows f32. Activations stay f32; weights are decoded block by block (no
 * dequantized copy of the matrix). Parallel over rows on `pool` (may be NULL). */
int lm_matmul(lm_pool *pool, int type, const void *w, int64_t rows, int64_t cols,
              const float *x, int64_t ntok, float *y);

/* Rows ids[i] of an embedding table (`type`, rows of `cols`) dequantized into
 * out[i * cols ..]. Returns LM_EINVAL if an id is outside [0, n_rows). */
int lm_get_rows(int type, const void *table, int64_t n_rows, int64_t cols,
                const int32_t *ids, int64_t n_ids, float *out);

/* ------------------------------------------------------------------ leaf ops (one thread) */
/* out = x / sqrt(mean(x^2) + eps) * (weight ? weight : 1); out may alias x. */
void lm_rmsnorm(float *out, const float *x, const float *weight, int64_t n, float eps);
/* Rotary embedding in place on one token's heads: x is n_heads x head_dim. The first
 * n_rot dims of each head rotate. mode LM_ROPE_NORMAL rotates adjacent pairs (2i, 2i+1);
 * LM_ROPE_NEOX rotates (i, i + n_rot/2). theta_i = pos * freq_scale * base^(-2i/n_rot). */
enum lm_rope_mode { LM_ROPE_NORMAL = 0, LM_ROPE_NEOX = 2 };
void lm_rope(float *x, int n_heads, int head_dim, int n_rot, int64_t pos, float freq_base,
             float freq_scale, int mode);
void lm_softmax(float *x, int64_t n);                          /* in place, stable */
void lm_silu_mul(float *out, const float *gate, const float *up, int64_t n); /* silu(g)*u */
void lm_gelu_mul(float *out, const float *gate, const float *up, int64_t n); /* gelu_tanh(g)*u */
void lm_add(float *out, const float *a, const float *b, int64_t n);
void lm_scale(float *x, float s, int64_t n);

/* ------------------------------------------------------------------ attention
 * Causal grouped-query attention for ntok query tokens at positions pos0 .. pos0+ntok-1
 * over cache rows [0, pos0+ntok) (the caller has already written the new tokens' rows).
 * q:   ntok x n_head x head_dim
 * k, v: cache, n_ctx x n_kv_head x head_dim (row stride n_kv_head * head_dim), f32
 * out: ntok x n_head x head_dim
 * Query head h reads kv head h / (n_head / n_kv_head). window > 0 limits each query to
 * the last `window` positions (sliding-window layers); softcap > 0 applies
 * softcap * tanh(score / softcap) before the softmax. Parallel over (token, head). */
int lm_attention(lm_pool *pool, const float *q, const float *k, const float *v, float *out,
                 int64_t ntok, int64_t pos0, int n_head, int n_kv_head, int head_dim,
                 float scale, int64_t window, float softcap);

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_KERNELS_H */
