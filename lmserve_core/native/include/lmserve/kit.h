/*
 * The family kit, as a family's forward pass sees it.
 *
 * A family module includes this header (never lmserve/kernels.h): every lm_* function below
 * calls the core's compiled kernels through the table the core hands over at load, so the
 * kernels exist once per process whatever the number of families. The module's main
 * translation unit defines LM_KIT_MAIN before including it (lmserve_core.native's
 * family_ffibuilder does), which defines the table pointer and lm_kit_bind.
 *
 * What a family writes: its config and weight structs (llama2.c style, a shape comment on
 * every pointer) and a build function that maps them onto the kit:
 *   - a pre-norm decoder (llama, qwen3, qwen35, gemma3, gemma4) fills the blocks of an
 *     lm_decoder_model between lm_decoder_new and lm_decoder_finish and runs on the kit's own
 *     chunk loop; what its blocks do is data (lm_block: the mixer, per-layer heads, windows
 *     and RoPE, shared caches, the feed-forward's kind and norms), and each step of its own
 *     between the blocks is a hook with its own context (lm_decoder_add_hook: begin_chunk,
 *     after_block, free; several compose, nested in the order added);
 *   - anything else makes its model struct with lm_model_new, fills the lm_base it starts
 *     with (lm_base_init) with its own forward_chunk, made of the layer helpers (lm_embed,
 *     lm_self_attention, lm_glu_ffn, lm_moe_ffn, lm_logits) and the threaded row ops; a
 *     router of its own feeds lm_moe_experts (its routing by lm_moe_route).
 * The kit owns the memory: a family's scratch and state (hook contexts, per-layer tables,
 * buffers of n_batch rows) come from the model's arena (lm_base_alloc) and are freed with
 * it by lm_model_free, so a family allocates and frees nothing itself.
 * Sizes are int64_t element counts; every function returns LM_OK or a negative status;
 * nothing exits or prints.
 */
#ifndef LMSERVE_KIT_H
#define LMSERVE_KIT_H

#include "lmserve/api.h"

#ifdef __cplusplus
extern "C" {
#endif

extern const lm_kit *lm_kit_api;

#define LM_KIT_WRAP_INT(ret, name, params, args)                                                  \
    static inline ret name params { return lm_kit_api->name args; }
#define LM_KIT_WRAP_VOID(name, params, args)                                                       \
    static inline void name params { lm_kit_api->name args; }
LM_KIT_INT(LM_KIT_WRAP_INT)
LM_KIT_VOID(LM_KIT_WRAP_VOID)
#undef LM_KIT_WRAP_INT
#undef LM_KIT_WRAP_VOID

/* Return from the enclosing function when a kit call fails. */
#define LM_TRY(call)                                                                               \
    do {                                                                                           \
        const int lm_rc_ = (call);                                                                 \
        if (lm_rc_ != LM_OK) return lm_rc_;                                                        \
    } while (0)

/* ------------------------------------------------------------------ weight tables
 * From a family's weight table (types.h: lm_attn_tensors, lm_ffn_tensors, lm_io_tensors,
 * lm_decoder_tensors) to the decoder's blocks. */

/* A block's attention over t: n_head query heads over n_kv_head key/value heads of width
 * head_dim, scores scaled by `scale`, q and k turned by rope (NULL: none) after their norms;
 * a fused wqkv is cut after q and after k. The family sets what else the layer has (window,
 * softcap, gated, v_norm, kv_shared). */
static inline lm_attn lm_block_attn(const lm_attn_tensors *t, int n_head, int n_kv_head,
                                    int head_dim, float scale, float norm_eps,
                                    const lm_rotary *rope, int64_t n_embd) {
    lm_matrix wq = t->wq, wk = t->wk, wv = t->wv;
    if (t->wqkv.data != NULL) {
        const int64_t qd = (int64_t)n_head * head_dim, kvd = (int64_t)n_kv_head * head_dim;
        wq = t->wqkv;
        wk = lm_matrix_rows(t->wqkv, qd, n_embd);
        wv = lm_matrix_rows(t->wqkv, qd + kvd, n_embd);
        if (wv.data == NULL) wk.data = NULL; /* not V from K: a cut the kit's check refuses */
    }
    return (lm_attn){
        .wq = wq, .wk = wk, .wv = wv, .wo = t->wo, .bq = t->bq, .bk = t->bk, .bv = t->bv,
        .q_norm = t->q_norm, .k_norm = t->k_norm, .norm_eps = norm_eps, .n_head = n_head,
        .n_kv_head = n_kv_head, .head_dim = head_dim, .scale = scale, .rope = rope,
    };
}

/* A block's norms (before and after each half) from its two halves' tensors. */
static inline void lm_block_norms(lm_block *b, const lm_attn_tensors *a, const lm_ffn_tensors *f,
                                  float norm_eps) {
    b->norm_eps = norm_eps;
    b->attn_norm = a->attn_norm;
    b->post_attn_norm = a->post_attn_norm;
    b->ffn_norm = f->ffn_norm;
    b->post_ffn_norm = f->post_ffn_norm;
}

/* The gated MLP of f: width n_ff, activation `act` (enum lm_act) on the gate. */
static inline lm_ffn lm_dense_ffn(const lm_ffn_tensors *f, int64_t n_ff, int act) {
    return (lm_ffn){f->ffn_gate, f->ffn_up, f->ffn_down, n_ff, act};
}

/* The experts of f: n_expert of width n_ff behind a softmax router, the top n_used
 * renormalised to sum to 1 and times `scale`; activation `act` on their gates. */
static inline lm_moe lm_softmax_experts(const lm_ffn_tensors *f, int n_expert, int n_used,
                                        int64_t n_ff, float scale, int act) {
    return (lm_moe){
        .router = f->ffn_gate_inp, .gate_exps = f->ffn_gate_exps, .up_exps = f->ffn_up_exps,
        .gate_up_exps = f->ffn_gate_up_exps, .down_exps = f->ffn_down_exps,
        .n_expert = n_expert, .n_used = n_used, .n_ff = n_ff, .gating = LM_GATING_SOFTMAX,
        .norm_weights = 1, .weights_scale = scale, .act = act,
    };
}

/* A SiLU feed-forward (Qwen's): an MLP of width n_ff when n_expert is 0, else n_expert
 * experts of width n_ff (lm_softmax_experts), with f's shared expert of width n_ff_shexp
 * where it has one. */
static inline void lm_block_silu_ffn(lm_block *b, const lm_ffn_tensors *f, int64_t n_ff,
                                     int n_expert, int n_used, float scale, int64_t n_ff_shexp) {
    if (n_expert == 0) {
        b->ffn = lm_dense_ffn(f, n_ff, LM_ACT_SILU);
        return;
    }
    b->moe = lm_softmax_experts(f, n_expert, n_used, n_ff, scale, LM_ACT_SILU);
    if (n_ff_shexp > 0) {
        b->shexp = (lm_ffn){f->ffn_gate_shexp, f->ffn_up_shexp, f->ffn_down_shexp, n_ff_shexp,
                            LM_ACT_SILU};
        b->shexp_gate = f->ffn_gate_inp_shexp;
    }
}

/* lm_decoder_new for d->n_layer blocks, with w's RoPE in place (m->rope, m->rope_swa) and,
 * where w has standard layers (w->layers not NULL), every block's norms and attention from
 * them: d's heads and widths, scores scaled by `scale`, sliding-window layers (swa) over
 * `window` positions with rope_swa. The family then fills what else its blocks have and
 * calls lm_decoder_end. */
static inline int lm_decoder_begin(const lm_dims *d, const lm_decoder_tensors *w, float scale,
                                   int64_t window, lm_decoder_model **out) {
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(d->n_layer, &m));
    m->rope = w->rope;
    m->rope_swa = w->rope_swa;
    for (int l = 0; w->layers != NULL && l < d->n_layer; l++) {
        const lm_layer_tensors *L = &w->layers[l];
        const int local = L->swa && window > 0;
        lm_block *b = &m->blocks[l];
        lm_block_norms(b, &L->attn, &L->ffn, d->rms_eps);
        b->attn = lm_block_attn(&L->attn, d->n_head, d->n_kv_head, d->head_dim, scale,
                                d->rms_eps, local ? &m->rope_swa : &m->rope, d->n_embd);
        b->attn.window = local ? window : 0;
    }
    *out = m;
    return LM_OK;
}

/* The decoder's input and output from io (the output norm's eps: norm_eps), then
 * lm_decoder_finish. */
static inline int lm_decoder_end(lm_decoder_model *m, const lm_io_tensors *io, float norm_eps,
                                 int n_vocab, int n_embd, int n_threads, int64_t n_batch,
                                 lm_base **out) {
    m->dec.token_embd = io->token_embd;
    m->dec.output_norm = io->output_norm;
    m->dec.output = io->output;
    m->dec.norm_eps = norm_eps;
    return lm_decoder_finish(m, n_threads, n_batch, n_vocab, n_embd, out);
}

/* n floats (zeroed, 64-byte aligned) of b's arena into *out; LM_ENOMEM when it fails. */
static inline int lm_base_floats(lm_base *b, int64_t n, float **out) {
    *out = NULL;
    if (n < 0) return LM_EINVAL;
    *out = (float *)lm_base_alloc(b, sizeof(float) * (size_t)n);
    return *out != NULL ? LM_OK : LM_ENOMEM;
}

/* 1 when m is a matrix of a type the kernels decode with rows of `cols` elements. */
static inline int lm_matrix_ok(lm_matrix m, int64_t cols) {
    return m.data != NULL && lm_row_bytes(m.type, cols) > 0;
}

#ifdef LM_KIT_MAIN
const lm_kit *lm_kit_api = NULL;

/* Take the core's table (lmserve_core.native.kernels.kit_table()); LM_EABI when the core was
 * built with another kit ABI than this module. */
int lm_kit_bind(const void *table) {
    const lm_kit *k = (const lm_kit *)table;
    if (k == NULL || k->abi != LM_KIT_ABI || k->size < sizeof(lm_kit)) return LM_EABI;
    lm_kit_api = k;
    return LM_OK;
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_KIT_H */
