/*
 * The kit ABI: the core functions a family module calls, as X-macro lists.
 *
 * The core compiles these once (lmserve_core._kernels) and hands a table of pointers to every
 * family module at load (lm_kit_bind, lmserve/kit.h); families never compile a copy. A new
 * function is appended to LM_KIT_INT, the table's last list, and bumps nothing (a module
 * built before it reads a longer table); any other change bumps LM_KIT_ABI.
 *
 * LM_KIT_INT(X):  X(return type, name, (parameters), (arguments))
 * LM_KIT_VOID(X): X(name, (parameters), (arguments))
 */
#ifndef LMSERVE_API_H
#define LMSERVE_API_H

#include "lmserve/types.h"

#define LM_KIT_ABI 8

#define LM_KIT_INT(X)                                                                              \
    X(int64_t, lm_row_bytes, (int type, int64_t n), (type, n))                                    \
    X(int, lm_base_init,                                                                           \
      (lm_base * b, int n_threads, int64_t n_batch, int64_t n_vocab, int64_t n_embd, int n_layer, \
       const lm_cache_layer *layers, lm_chunk_fn forward_chunk, void (*free_model)(void *)),      \
      (b, n_threads, n_batch, n_vocab, n_embd, n_layer, layers, forward_chunk, free_model))       \
    X(void *, lm_base_tmp, (lm_base * b, size_t bytes), (b, bytes))                               \
    X(int, lm_matmul,                                                                              \
      (lm_pool * pool, int type, const void *w, int64_t rows, int64_t cols, const float *x,      \
       int64_t ntok, float *y),                                                                    \
      (pool, type, w, rows, cols, x, ntok, y))                                                     \
    X(int, lm_matmuls, (lm_pool * pool, const lm_mm *mms, int n, int64_t ntok),                  \
      (pool, mms, n, ntok))                                                                        \
    X(int, lm_get_rows,                                                                            \
      (int type, const void *table, int64_t n_rows, int64_t cols, const int32_t *ids,             \
       int64_t n_ids, float *out),                                                                 \
      (type, table, n_rows, cols, ids, n_ids, out))                                                \
    X(int, lm_rmsnorm_rows,                                                                        \
      (lm_pool * pool, float *out, const float *x, const float *w, int64_t rows, int64_t n,      \
       float eps),                                                                                 \
      (pool, out, x, w, rows, n, eps))                                                             \
    X(int, lm_rope_rows,                                                                           \
      (lm_pool * pool, float *x, int64_t ntok, int n_heads, int head_dim, int64_t pos0,          \
       const lm_rotary *rope),                                                                     \
      (pool, x, ntok, n_heads, head_dim, pos0, rope))                                              \
    X(int, lm_glu_rows,                                                                            \
      (lm_pool * pool, float *out, const float *gate, const float *up, int64_t n, int act),      \
      (pool, out, gate, up, n, act))                                                               \
    X(int, lm_add_rows, (float *y, const float *x, int64_t n), (y, x, n))                         \
    X(int, lm_scale_rows, (float *x, float s, int64_t n), (x, s, n))                              \
    X(int, lm_softcap_rows, (float *x, int64_t n, float cap), (x, n, cap))                        \
    X(int, lm_cache_write,                                                                         \
      (lm_cache * c, int layer, int64_t pos0, int64_t ntok, const float *k, const float *v),     \
      (c, layer, pos0, ntok, k, v))                                                                \
    X(int, lm_attention_cached,                                                                    \
      (lm_pool * pool, const float *q, const lm_cache *c, int layer, float *out, int64_t ntok,   \
       int64_t pos0, int n_head, float scale, int64_t window, float softcap),                     \
      (pool, q, c, layer, out, ntok, pos0, n_head, scale, window, softcap))                       \
    X(int, lm_embed, (lm_base * b, lm_matrix table, const int32_t *tokens, int64_t ntok),        \
      (b, table, tokens, ntok))                                                                    \
    X(int, lm_self_attention,                                                                      \
      (lm_base * b, const lm_attn *a, int layer, const float *x, int64_t ntok, float *y),        \
      (b, a, layer, x, ntok, y))                                                                   \
    X(int, lm_glu_ffn, (lm_base * b, const lm_ffn *f, const float *x, int64_t ntok, float *y),   \
      (b, f, x, ntok, y))                                                                          \
    X(int, lm_moe_ffn,                                                                             \
      (lm_base * b, const lm_moe *m, int layer, const float *x, int64_t ntok, float *y),         \
      (b, m, layer, x, ntok, y))                                                                   \
    X(int, lm_moe_route, (const lm_moe * m, float *logits, int32_t *ids, float *w),             \
      (m, logits, ids, w))                                                                         \
    X(int, lm_moe_experts,                                                                         \
      (lm_base * b, const lm_moe *m, const float *x, int64_t ntok, const int32_t *ids,           \
       const float *w, float *y),                                                                  \
      (b, m, x, ntok, ids, w, y))                                                                  \
    X(int, lm_logits,                                                                              \
      (lm_base * b, const float *norm, float eps, lm_matrix out, const float *x, int64_t n,      \
       float softcap, float *logits),                                                              \
      (b, norm, eps, out, x, n, softcap, logits))                                                 \
    X(int, lm_decoder_block,                                                                       \
      (lm_base * b, const lm_block *blk, int layer, int64_t r0, int64_t n),                       \
      (b, blk, layer, r0, n))                                                                      \
    X(int, lm_decoder_chunk,                                                                       \
      (lm_base * b, const lm_decoder *d, const int32_t *tokens, int64_t ntok, float *logits,     \
       int64_t first_logit),                                                                       \
      (b, d, tokens, ntok, logits, first_logit))                                                   \
    X(int, lm_decoder_check, (const lm_base *b, const lm_decoder *d), (b, d))                    \
    X(int, lm_decoder_new, (int n_layer, lm_decoder_model **out), (n_layer, out))                \
    X(int, lm_decoder_finish,                                                                      \
      (lm_decoder_model * m, int n_threads, int64_t n_batch, int64_t n_vocab, int64_t n_embd,     \
       lm_base **out),                                                                             \
      (m, n_threads, n_batch, n_vocab, n_embd, out))                                              \
    X(int, lm_attend,                                                                              \
      (lm_base * b, const lm_attn *a, int layer, int src, float *q, float *k, const float *v,    \
       int64_t r0, int64_t n, float *att),                                                         \
      (b, a, layer, src, q, k, v, r0, n, att))                                                    \
    X(lm_matrix, lm_matrix_rows, (lm_matrix m, int64_t row0, int64_t cols), (m, row0, cols))  \
    X(float *, lm_cache_layer_state, (lm_cache * c, int layer), (c, layer))                      \
    X(int, lm_deltanet_mixer,                                                                      \
      (lm_base * b, const lm_deltanet *d, int layer, const float *x, int64_t ntok, float *y),    \
      (b, d, layer, x, ntok, y))                                                                   \
    X(int, lm_attention_cached_bias,                                                               \
      (lm_pool * pool, const float *q, const lm_cache *c, int layer, float *out, int64_t ntok,   \
       int64_t pos0, int n_head, float scale, int64_t window, float softcap, const float *bias,  \
       int64_t bias_extent),                                                                       \
      (pool, q, c, layer, out, ntok, pos0, n_head, scale, window, softcap, bias, bias_extent))  \
    X(int, lm_model_new, (size_t bytes, lm_base **out), (bytes, out))                            \
    X(void *, lm_base_alloc, (lm_base * b, size_t bytes), (b, bytes))                             \
    X(int, lm_decoder_add_hook, (lm_decoder_model * m, const lm_hook *hook), (m, hook))          \
    X(void *, lm_decoder_hook_ctx,                                                                 \
      (lm_base * b, lm_begin_chunk_fn begin_chunk, lm_after_block_fn after_block),                \
      (b, begin_chunk, after_block))                                                             \
    X(float *, lm_cache_snapshot_layer, (lm_cache * c, int64_t end, int layer), (c, end, layer))

#define LM_KIT_VOID(X) X(lm_base_free, (lm_base * b), (b)) X(lm_model_free, (lm_base * b), (b))

/* The table: an ABI tag, its own size, then one pointer per function above. */
#define LM_KIT_FIELD_INT(ret, name, params, args) ret(*name) params;
#define LM_KIT_FIELD_VOID(name, params, args) void(*name) params;
typedef struct lm_kit {
    uint32_t abi;
    uint32_t size;
    LM_KIT_VOID(LM_KIT_FIELD_VOID)
    LM_KIT_INT(LM_KIT_FIELD_INT)
} lm_kit;
#undef LM_KIT_FIELD_INT
#undef LM_KIT_FIELD_VOID

#endif /* LMSERVE_API_H */
