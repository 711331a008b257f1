/*
 * lmserve shared native kernels: the core's own view.
 *
 * One copy of the GGUF block formats, their dot products and GEMM, the leaf ops of a
 * transformer forward pass, a thread pool, and the family kit (KV caches, threaded row ops,
 * layer helpers, the chunk driver). The core builds them once into its cffi module
 * (lmserve_core._kernels); family modules reach them through the table of lmserve/kit.h.
 *
 * Conventions: functions return LM_OK (0) or a negative status; they never exit or print.
 * Sizes are int64_t element counts. Callers validate every pointer and size.
 *
 * The region between the cdef markers is the cffi declaration of these functions (plain C
 * declarations only, no preprocessor lines); the types are in lmserve/types.h.
 */
#ifndef LMSERVE_KERNELS_H
#define LMSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "lmserve/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

/* ------------------------------------------------------------------ tensor types */
int64_t lm_type_block_elems(int type); /* elements per block; <= 0: unknown type */
int64_t lm_type_block_bytes(int type); /* bytes per block;    <= 0: unknown type */
int64_t lm_row_bytes(int type, int64_t n); /* bytes of an n-element row; < 0 if invalid */

/* ------------------------------------------------------------------ ISA dispatch */
int lm_isa_best(void);          /* the best ISA this CPU supports */
int lm_isa_active(void);        /* the ISA kernels currently use (default: best) */
int lm_isa_select(int isa);     /* LM_EISA if the CPU lacks it; process-wide */
int lm_isa_available(int isa);  /* 1 when this CPU (and build) can run the path */
/* enum lm_decode_precision of the few-token products; process-wide, default LM_DECODE_I16. */
int lm_decode_precision_active(void);
int lm_decode_precision_select(int precision);
/* enum lm_prefill_precision of the many-token products; process-wide, default LM_PREFILL_I16. */
int lm_prefill_precision_active(void);
int lm_prefill_precision_select(int precision);
/* 1 when a product of ntok tokens with `type` weights runs on int16 activations under the
 * active ISA and precisions (so its outputs have the bits of each token alone), else 0. */
int lm_int_products_active(int type, int64_t ntok);

/* ------------------------------------------------------------------ rows */
/* dst[0..n) = dequantized src row. */
int lm_dequantize_row(int type, const void *src, float *dst, int64_t n);
/* *out = dot(row (n elements of `type`), x (n floats)). */
int lm_vec_dot(int type, const void *row, const float *x, int64_t n, float *out);
/* The same through int16 activations (LM_ETYPE for a type without an integer path). */
int lm_vec_dot_i16(int type, const void *row, const float *x, int64_t n, float *out);
/* The n elements of a row of `from` (src) rewritten exactly as type `to` (dst): the same
 * values, in a layout whose products are cheaper. Only Q5_0 -> Q8_0 (the 5-bit integers
 * widened to bytes, the scale kept); LM_ETYPE for any other pair. */
int lm_convert_row(int from, const void *src, int to, void *dst, int64_t n);
/* The interleaved layout (enum lm_r16_type) of `type` that the active ISA's products read
 * faster than `type` itself, or 0 when there is none. */
int lm_r16_for(int type);
/* rows x cols of `from` (GGML blocks, row-major; rows a multiple of 16) rewritten into dst as
 * `to`, the lm_r16_type of `from`: the same bytes in another order. LM_ETYPE for any other
 * pair. */
int lm_repack_r16(int from, const void *src, int to, void *dst, int64_t rows, int64_t cols);
/* x[0..n) (n a multiple of 32) as the int16 activations: q[n] and, per group of 32, its
 * step and its f32 sum in ds[2g], ds[2g + 1]. */
int lm_quantize_x16(const float *x, int64_t n, int16_t *q, float *ds);

/* ------------------------------------------------------------------ thread pool */
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


/* ------------------------------------------------------------------ threaded row ops
 * Spread over `pool` by rows (inline for small inputs; pool may be NULL). */
/* out[r] = rmsnorm(x[r]) * w for rows r of n elements; w may be NULL; out may alias x. Per-head
 * norms are rows of head_dim: rows = ntok * n_heads. */
int lm_rmsnorm_rows(lm_pool *pool, float *out, const float *x, const float *w, int64_t rows,
                    int64_t n, float eps);
/* RoPE in place on x (ntok, n_heads, head_dim); token t sits at position pos0 + t. */
int lm_rope_rows(lm_pool *pool, float *x, int64_t ntok, int n_heads, int head_dim, int64_t pos0,
                 const lm_rotary *rope);
/* out = act(gate) * up over n elements, or act(gate) alone when up is NULL; out may alias
 * gate. */
int lm_glu_rows(lm_pool *pool, float *out, const float *gate, const float *up, int64_t n,
                int act);
int lm_add_rows(float *y, const float *x, int64_t n);   /* y += x */
int lm_scale_rows(float *x, float s, int64_t n);        /* x *= s */
int lm_softcap_rows(float *x, int64_t n, float cap);    /* x = cap * tanh(x / cap) */
/* Several products in one call: for a few tokens the rows of every matrix are split across
 * the pool in one dispatch (decode wakes the pool once for q, k and v); for many tokens each
 * product runs the GEMM path. */
int lm_matmuls(lm_pool *pool, const lm_mm *mms, int n, int64_t ntok);

/* ------------------------------------------------------------------ KV cache
 * Per layer, K rows (rows, n_kv_head * head_dim_k) and V rows (rows, n_kv_head * head_dim_v)
 * stored as `type` (LM_F16 or LM_F32): rows is n_ctx, or a ring's size (lm_cache_layer.ring,
 * position p in row p % ring) when smaller. Zeroed pages are mapped lazily, so memory follows
 * the positions actually written. A ring holds the last `ring` positions written: copies,
 * state and attention over it are valid for positions still resident. */
int lm_cache_new(int n_layer, const lm_cache_layer *layers, int64_t n_ctx, int type,
                 lm_cache **out);
void lm_cache_free(lm_cache *cache);
int64_t lm_cache_n_ctx(const lm_cache *cache);
int lm_cache_type(const lm_cache *cache);
/* Bytes one position takes in the layers with a row per position (K and V); ring layers
 * (sliding windows) take a fixed size whatever the context. */
int64_t lm_cache_bytes_per_pos(int n_layer, const lm_cache_layer *layers, int type);
/* Bytes of a whole cache of n_ctx positions: every row of every layer, rings included. */
int64_t lm_cache_bytes(int n_layer, const lm_cache_layer *layers, int64_t n_ctx, int type);
/* Positions [0, n) of every layer from src into dst (same geometry and type); for a ring,
 * the rows it holds. */
int lm_cache_copy(const lm_cache *src, lm_cache *dst, int64_t n);
/* Rows pos0.. of one layer from f32 k (ntok, kv_dim_k) and v (ntok, kv_dim_v), rounded to
 * the cache's type (round to nearest even). */
int lm_cache_write(lm_cache *cache, int layer, int64_t pos0, int64_t ntok, const float *k,
                   const float *v);
/* Rows pos0.. of one layer back as f32. */
int lm_cache_read(const lm_cache *cache, int layer, int64_t pos0, int64_t ntok, float *k,
                  float *v);
/* The state of positions [0, n): lm_cache_state_bytes bytes saved into / loaded from buf. */
int64_t lm_cache_state_bytes(const lm_cache *cache, int64_t n);
int lm_cache_save(const lm_cache *cache, int64_t n, void *buf, int64_t buf_bytes);
int lm_cache_load(lm_cache *cache, int64_t n, const void *buf, int64_t buf_bytes);
/* A recurrent layer's state (lm_cache_layer.state f32 values), NULL for a layer without. */
float *lm_cache_layer_state(lm_cache *cache, int layer);
/* Every layer's recurrent state at once (a snapshot of what cannot be cut back): its bytes,
 * saved into / loaded from buf (exactly that many bytes), zeroed (the state before position
 * 0), copied between caches of the same geometry. */
int64_t lm_cache_recurrent_bytes(const lm_cache *cache);
int lm_cache_recurrent_save(const lm_cache *cache, void *buf, int64_t buf_bytes);
int lm_cache_recurrent_load(lm_cache *cache, const void *buf, int64_t buf_bytes);
int lm_cache_recurrent_reset(lm_cache *cache);
/* While the next chunks are read, keep every layer's recurrent state as a prompt of pos[i]
 * positions leaves it (after the row at pos[i] - 1) in buf's i-th n_state floats, laid out
 * as lm_cache_recurrent_save writes it: one pass takes the checkpoints a prompt plans, where
 * stopping at each would read the weights again. At most LM_MAX_SNAPSHOTS; n = 0 ends it. */
int lm_cache_plan_snapshots(lm_cache *cache, const int64_t *pos, int n, void *buf,
                            int64_t buf_bytes);
/* For a recurrent mixer: where layer's state after `end` positions is kept, or NULL. */
float *lm_cache_snapshot_layer(lm_cache *cache, int64_t end, int layer);
int lm_cache_recurrent_copy(const lm_cache *src, lm_cache *dst);
/* lm_attention over one layer of a cache (rows [0, pos0 + ntok) already written). */
int lm_attention_cached(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                        float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                        int64_t window, float softcap);
/* lm_attention_cached plus bias (ntok, n_head, bias_extent): bias[t, h, d] is added to the
 * scaled score of query (t, h) and the key d positions before it, for d < bias_extent (a
 * learned relative position bias; farther keys take none). bias NULL, extent 0: none. */
int lm_attention_cached_bias(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                             float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                             int64_t window, float softcap, const float *bias,
                             int64_t bias_extent);
/* lm_attention_cached; bidir: every query sees every key of the chunk and those of the window
 * before its first position (a block-diffusion canvas), not only the keys up to its own. */
int lm_attention_cached_span(lm_pool *pool, const float *q, const lm_cache *cache, int layer,
                             float *out, int64_t ntok, int64_t pos0, int n_head, float scale,
                             int64_t window, float softcap, int bidir);

/* ------------------------------------------------------------------ model base and layers */
/* A family model's struct of `bytes` (at least an lm_base, which it starts with), zeroed, as
 * the first allocation of its own arena: lm_model_free frees it with everything
 * lm_base_alloc handed out for it. */
int lm_model_new(size_t bytes, lm_base **out);
/* `bytes` of zeroed memory, 64-byte aligned, that live as long as b's model (its arena):
 * the family's scratch and state; NULL when out of memory. */
void *lm_base_alloc(lm_base *b, size_t bytes);
/* Fill the kit's part of a family model: a pool of n_threads (<= 0: one per core), the
 * residual buffers for n_batch tokens, the cache geometry (borrowed) and the family's
 * callbacks (free_model NULL: lm_base_free). Keeps the arena; on failure releases what it
 * allocated (the model is then the caller's to free). */
int lm_base_init(lm_base *b, int n_threads, int64_t n_batch, int64_t n_vocab, int64_t n_embd,
                 int n_layer, const lm_cache_layer *layers, lm_chunk_fn forward_chunk,
                 void (*free_model)(void *));
/* Releases the kit's buffers, then the arena (the model's struct too when lm_model_new made
 * it: b is gone after the call). */
void lm_base_free(lm_base *b);
/* Scratch of at least `bytes` (64-byte aligned) owned by b, valid until the next call. */
void *lm_base_tmp(lm_base *b, size_t bytes);
int lm_base_threads(const lm_base *b);
/* b->x = rows `tokens` of the embedding table. */
int lm_embed(lm_base *b, lm_matrix table, const int32_t *tokens, int64_t ntok);
/* Rows [row0, ..) of m (rows of `cols` elements) as a matrix of their own, whatever m's
 * layout; no data (which every product refuses) where an interleaved matrix would be cut
 * inside a group of 16 rows. */
lm_matrix lm_matrix_rows(lm_matrix m, int64_t row0, int64_t cols);
/* Attention of rows [r0, r0 + n) of the running chunk, each in its own sequence (b->seqs):
 * rotates q (n, n_head * head_dim) and, when k is not NULL, k (n, n_kv_head * head_dim) in
 * place at each row's position by a->rope (NULL: none), writes k and v as the rows' entries
 * of cache layer `layer`, then attends q over cache layer `src` (`layer`, or an earlier layer
 * whose K/V this one shares) into att (n, n_head * head_dim). a's weights are not read. */
int lm_attend(lm_base *b, const lm_attn *a, int layer, int src, float *q, float *k,
              const float *v, int64_t r0, int64_t n, float *att);
/* y (ntok, n_embd) = self-attention of normed x (ntok, n_embd), the chunk's rows [0, ntok),
 * writing their cache rows (or reading an earlier layer's: a->kv_shared). */
int lm_self_attention(lm_base *b, const lm_attn *a, int layer, const float *x, int64_t ntok,
                      float *y);
/* y (ntok, n_embd) = the gated DeltaNet mixer of normed x (ntok, n_embd), the chunk's rows
 * [0, ntok), each sequence's rows continuing from (and updating) its state in cache layer
 * `layer`. */
int lm_deltanet_mixer(lm_base *b, const lm_deltanet *d, int layer, const float *x, int64_t ntok,
                      float *y);
/* y (ntok, n_embd) = gated feed-forward of x. */
int lm_glu_ffn(lm_base *b, const lm_ffn *f, const float *x, int64_t ntok, float *y);
/* y (ntok, n_embd) = weighted sum of each token's chosen experts (m's router and experts
 * reading x through their norms when m has them). Decode reads only the
 * chosen experts' weights; a chunk groups its tokens by expert, so each chosen expert's
 * weights are streamed once per chunk. */
int lm_moe_ffn(lm_base *b, const lm_moe *m, int layer, const float *x, int64_t ntok, float *y);
/* One token's routing: from its router logits (n_expert, overwritten by the gate's
 * probabilities), the n_used chosen experts (ties keep the lower index) and their weights,
 * by m's gating, renormalisation, scale and expert scales. */
int lm_moe_route(const lm_moe *m, float *logits, int32_t *ids, float *w);
/* y (ntok, n_embd) = for each token t, the sum over its n_used choices k of
 * w[t * n_used + k] * expert ids[t * n_used + k] of m applied to row t of x (ntok, n_embd):
 * the experts of a routing made by the caller (as lm_moe_route returns it; m's router,
 * gating and norms are not used). Same grouping as lm_moe_ffn. y may alias x; ids, w and x may lie in
 * the base's scratch (lm_base_tmp) carved by the caller, and are kept. LM_EINVAL for an id
 * outside [0, n_expert). */
int lm_moe_experts(lm_base *b, const lm_moe *m, const float *x, int64_t ntok, const int32_t *ids,
                   const float *w, float *y);
/* logits (n, n_vocab) = out . rmsnorm(x rows) * norm, then softcap (0: none); the normed rows
 * also into b->hidden when set, and nothing else when logits is NULL (hidden set). */
int lm_logits(lm_base *b, const float *norm, float eps, lm_matrix out, const float *x, int64_t n,
              float softcap, float *logits);
/* One pre-norm block over rows [r0, r0 + n) of b->x (b->xb is its scratch); its mixer and
 * feed-forward, not its out_scale. A recurrent mixer runs from row 0 only. */
int lm_decoder_block(lm_base *b, const lm_block *blk, int layer, int64_t r0, int64_t n);
/* A whole chunk of a pre-norm decoder: a family's forward_chunk can be this one call. Runs
 * the decoder's hooks and each block's out_scale. */
int lm_decoder_chunk(lm_base *b, const lm_decoder *d, const int32_t *tokens, int64_t ntok,
                     float *logits, int64_t first_logit);
/* LM_OK when every matrix of the decoder has a type the kernels decode and every pointer is
 * set, for the base's sizes; LM_ETYPE / LM_EINVAL otherwise (run it before lm_base_init's
 * model serves a call). */
int lm_decoder_check(const lm_base *b, const lm_decoder *d);
/* A decoder model whose n_layer blocks the family fills next (zeroed); until
 * lm_decoder_finish, lm_model_free(&m->base) frees it. */
int lm_decoder_new(int n_layer, lm_decoder_model **out);
/* Appends a hook to the decoder's (at most 4): the model owns its ctx from this call on,
 * also when the call fails (LM_EINVAL: no room, or neither function set). */
int lm_decoder_add_hook(lm_decoder_model *m, const lm_hook *hook);
/* The ctx of b's first decoder hook with exactly these functions; NULL when b is not a kit
 * decoder model or has none. */
void *lm_decoder_hook_ctx(lm_base *b, lm_begin_chunk_fn begin_chunk,
                          lm_after_block_fn after_block);
/* Derive the cache geometry from the blocks, start the base and check every weight; *out is
 * the model's lm_base, freed by lm_model_free. On failure the model is freed. */
int lm_decoder_finish(lm_decoder_model *m, int n_threads, int64_t n_batch, int64_t n_vocab,
                      int64_t n_embd, lm_base **out);
/* The chunk driver: tokens[0..ntok) at positions pos.., in chunks of n_batch; logits of the
 * last token, or (ntok, n_vocab) with all_logits. Checks ids, positions and cache geometry. */
int lm_forward(lm_base *b, lm_cache *cache, const int32_t *tokens, int64_t ntok, int64_t pos,
               float *logits, int all_logits);
/* One chunk (ntok <= n_batch) whose rows see each other both ways (lm_seq.bidirectional: a
 * block-diffusion canvas after its prefix, or the window of it): writes the chunk's cache rows
 * at positions pos.. and logits (ntok, n_vocab) of every row. Checks as lm_forward. */
int lm_forward_bidirectional(lm_base *b, lm_cache *cache, const int32_t *tokens, int64_t ntok,
                             int64_t pos, float *logits);
/* One step of several sequences in one weight pass: sequence i runs ntoks[i] tokens (taken
 * in order from tokens) at positions pos[i].. of caches[i]; logits (sum ntoks, n_vocab) of
 * every row. At most n_batch rows in all; the caches are distinct. Checks as lm_forward.
 * logits NULL: only b->hidden's rows, for a decoder the kit runs whole (else LM_EINVAL). */
int lm_forward_batch(lm_base *b, int n_seqs, lm_cache *const *caches, const int32_t *tokens,
                     const int64_t *ntoks, const int64_t *pos, float *logits);
/* Frees a family model through its free_model callback (NULL: lm_base_free). */
void lm_model_free(lm_base *b);
/* The table handed to family modules (lmserve/kit.h). */
const void *lm_kit_table(void);

/* cdef-end */

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_KERNELS_H */
