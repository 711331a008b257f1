/*
 * Forward pass of the llama architecture over the lmserve kit.
 *
 * Per layer:  x += attention(rmsnorm(x))         (rope on q and k, grouped-query heads)
 *             x += w_down . (silu(w_gate . rmsnorm(x)) * (w_up . rmsnorm(x)))
 */
#include "llama_forward.h"

#include <math.h>
#include <stdlib.h>

/* ============================================================================ model */

typedef struct llama_model {
    lm_base base; /* first: the kit drives the model through it */
    llama_config cfg;
    llama_weights w;
    lm_cache_layer *cache_layers; /* (n_layer) */
    lm_attn *attn;                /* (n_layer) */
    lm_ffn *ffn;                  /* (n_layer) */
} llama_model;

static void llama_free(void *self) {
    llama_model *m = self;
    lm_base_free(&m->base);
    free(m->cache_layers);
    free(m->attn);
    free(m->ffn);
    free(m);
}

/* ============================================================================ forward */

static int llama_chunk(void *self, lm_cache *cache, const int32_t *tokens, int64_t ntok,
                       int64_t pos0, float *logits, int64_t first_logit) {
    llama_model *m = self;
    lm_base *b = &m->base;
    const llama_config *c = &m->cfg;
    const int64_t n = ntok * c->n_embd;
    LM_TRY(lm_embed(b, m->w.token_embd, tokens, ntok));
    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &m->w.layers[l];
        LM_TRY(lm_rmsnorm_rows(b->pool, b->xb, b->x, L->attn_norm, ntok, c->n_embd, c->rms_eps));
        LM_TRY(lm_self_attention(b, &m->attn[l], cache, l, b->xb, ntok, pos0, b->xb));
        LM_TRY(lm_add_rows(b->x, b->xb, n));
        LM_TRY(lm_rmsnorm_rows(b->pool, b->xb, b->x, L->ffn_norm, ntok, c->n_embd, c->rms_eps));
        LM_TRY(lm_glu_ffn(b, &m->ffn[l], b->xb, ntok, b->xb));
        LM_TRY(lm_add_rows(b->x, b->xb, n));
    }
    return lm_logits(b, m->w.output_norm, c->rms_eps, m->w.output,
                     b->x + first_logit * c->n_embd, ntok - first_logit, 0.0f, logits);
}

/* ============================================================================ build */

static int llama_check(const llama_config *c, const llama_weights *w) {
    if (c->n_layer <= 0 || c->n_embd <= 0 || c->n_ff <= 0 || c->n_head <= 0 ||
        c->n_kv_head <= 0 || c->n_head % c->n_kv_head != 0 || c->head_dim <= 0 ||
        c->n_vocab <= 0 || w->layers == NULL || w->output_norm == NULL ||
        w->rope.n_rot > c->head_dim)
        return LM_EINVAL;
    const int64_t qd = (int64_t)c->n_head * c->head_dim;
    if (!lm_matrix_ok(w->token_embd, c->n_embd) || !lm_matrix_ok(w->output, c->n_embd))
        return LM_ETYPE;
    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &w->layers[l];
        if (L->attn_norm == NULL || L->ffn_norm == NULL) return LM_EINVAL;
        if (!lm_matrix_ok(L->wq, c->n_embd) || !lm_matrix_ok(L->wk, c->n_embd) ||
            !lm_matrix_ok(L->wv, c->n_embd) || !lm_matrix_ok(L->wo, qd) ||
            !lm_matrix_ok(L->w_gate, c->n_embd) || !lm_matrix_ok(L->w_up, c->n_embd) ||
            !lm_matrix_ok(L->w_down, c->n_ff))
            return LM_ETYPE;
    }
    return LM_OK;
}

int llama_build(const llama_config *config, const llama_weights *weights, int n_threads,
                int64_t n_batch, lm_base **out) {
    if (config == NULL || weights == NULL || out == NULL) return LM_EINVAL;
    *out = NULL;
    LM_TRY(llama_check(config, weights));
    llama_model *m = calloc(1, sizeof *m);
    if (m == NULL) return LM_ENOMEM;
    const llama_config *c = config;
    m->cfg = *c;
    m->w = *weights;
    m->cache_layers = calloc((size_t)c->n_layer, sizeof *m->cache_layers);
    m->attn = calloc((size_t)c->n_layer, sizeof *m->attn);
    m->ffn = calloc((size_t)c->n_layer, sizeof *m->ffn);
    if (m->cache_layers == NULL || m->attn == NULL || m->ffn == NULL) {
        llama_free(m);
        return LM_ENOMEM;
    }
    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &weights->layers[l];
        m->cache_layers[l] = (lm_cache_layer){c->n_kv_head, c->head_dim, c->head_dim};
        m->attn[l] = (lm_attn){
            .wq = L->wq, .wk = L->wk, .wv = L->wv, .wo = L->wo,
            .n_head = c->n_head, .n_kv_head = c->n_kv_head, .head_dim = c->head_dim,
            .scale = 1.0f / sqrtf((float)c->head_dim),
            .rope = &m->w.rope,
        };
        m->ffn[l] = (lm_ffn){L->w_gate, L->w_up, L->w_down, c->n_ff, LM_ACT_SILU};
    }
    const int rc = lm_base_init(&m->base, n_threads, n_batch, c->n_vocab, c->n_embd, c->n_layer,
                                m->cache_layers, llama_chunk, llama_free);
    if (rc != LM_OK) {
        llama_free(m);
        return rc;
    }
    *out = &m->base;
    return LM_OK;
}
