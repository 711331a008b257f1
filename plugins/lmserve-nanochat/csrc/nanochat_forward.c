/*
 * Forward pass of nanochat's GPT over the lmserve kit (see nanochat_forward.h).
 *
 * The blocks are the kit's; what lies between them runs in the decoder's hooks:
 *   begin_chunk   the embedding's norm, the smear (the token before each sequence's first row
 *                 from the table nanochat_previous fills), x0, then layer 0's input
 *   after_block   the backout copy, then layer i + 1's input (the lambdas, the value
 *                 embeddings' rows of the chunk's tokens); after the last, the backout
 */
#include "nanochat_forward.h"

#include <math.h>
#include <string.h>

/* A cache's continuation: the position its next chunk starts at and the token before it. */
typedef struct nc_prev {
    const lm_cache *cache;
    int64_t pos;
    int32_t token;
} nc_prev;

/* The hooks' context; it and its buffers lie in the model's arena. */
typedef struct nc_ctx {
    int n_layer;
    int64_t D, KVD, n_vocab;
    float eps;
    int backout_layer;
    int smear_cols;
    lm_matrix token_embd;
    const float *resid, *x0l;     /* (n_layer) or NULL */
    const float *smear_gate, *smear_lambda, *backout_lambda;
    lm_matrix *ve;                /* (n_layer) value-embedding tables (data NULL: none) */
    const int32_t *tokens;        /* the running chunk's */
    float *x0;                    /* (n_batch, D) the smeared embeddings */
    float *xback;                 /* (n_batch, D) the residual after backout_layer */
    float *ve_rows;               /* (n_batch, KVD) the value embeddings of the chunk's rows */
    float *row;                   /* (D) the previous token's embedding */
    nc_prev *prev;                /* (cap) */
    int n_prev, cap;
} nc_ctx;

static int nc_begin_chunk(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok);
static int nc_after_block(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n);

int nanochat_previous(lm_base *model, int n, lm_cache *const *caches, const int64_t *pos,
                      const int32_t *tokens) {
    if (model == NULL || n < 0 || (n > 0 && (caches == NULL || pos == NULL || tokens == NULL)))
        return LM_EINVAL;
    nc_ctx *c = lm_decoder_hook_ctx(model, nc_begin_chunk, nc_after_block);
    if (c == NULL || n > c->cap) return LM_EINVAL;
    for (int i = 0; i < n; i++) {
        if (caches[i] == NULL || pos[i] < 0 || (pos[i] > 0 && tokens[i] < 0) ||
            tokens[i] >= c->n_vocab)
            return LM_EINVAL;
        c->prev[i] = (nc_prev){caches[i], pos[i], tokens[i]};
    }
    c->n_prev = n;
    return LM_OK;
}

/* The table's entry of cache `cache`, or NULL. */
static nc_prev *nc_find(nc_ctx *c, const lm_cache *cache) {
    for (int i = 0; i < c->n_prev; i++)
        if (c->prev[i].cache == cache) return &c->prev[i];
    return NULL;
}

static float nc_sigmoid_dot(const float *w, const float *x, int n) {
    float dot = 0.0f;
    for (int i = 0; i < n; i++) dot += w[i] * x[i];
    return 1.0f / (1.0f + expf(-dot));
}

/* x (rows, D) += smear_lambda sigmoid(smear_gate . x[:cols]) * prev, prev being each row's
 * previous token's normed embedding: the row before it in the chunk (pre holds the rows before
 * the smear) or, for a sequence's first row, the token the table names. */
static int nc_smear(nc_ctx *c, lm_base *b, const float *pre) {
    const int64_t D = c->D;
    int64_t row0 = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const lm_seq *sq = &b->seqs[s];
        nc_prev *e = nc_find(c, sq->cache);
        if (sq->pos > 0 && (e == NULL || e->pos != sq->pos)) return LM_EINVAL;
        for (int64_t t = row0; t < row0 + sq->ntok; t++) {
            const float *prev = t > row0 ? pre + (t - 1) * D : NULL;
            if (t == row0 && sq->pos > 0) {
                LM_TRY(lm_get_rows(c->token_embd.type, c->token_embd.data, c->n_vocab, D,
                                   &e->token, 1, c->row));
                LM_TRY(lm_rmsnorm_rows(NULL, c->row, c->row, NULL, 1, D, c->eps));
                prev = c->row;
            }
            if (prev == NULL) continue;
            const float g =
                c->smear_lambda[0] * nc_sigmoid_dot(c->smear_gate, pre + t * D, c->smear_cols);
            float *x = b->x + t * D;
            for (int64_t i = 0; i < D; i++) x[i] += g * prev[i];
        }
        if (e != NULL) { /* the next chunk of this sequence continues after this one */
            e->pos = sq->pos + sq->ntok;
            e->token = c->tokens[row0 + sq->ntok - 1];
        }
        row0 += sq->ntok;
    }
    return LM_OK;
}

/* Layer l's input over rows [r0, r0 + n): the lambdas, and its value embeddings' rows. */
static int nc_layer_input(nc_ctx *c, lm_base *b, int l, int64_t r0, int64_t n) {
    const int64_t D = c->D;
    if (c->resid != NULL) {
        const float a = c->resid[l], k = c->x0l[l];
        float *x = b->x + r0 * D;
        const float *x0 = c->x0 + r0 * D;
        for (int64_t i = 0; i < n * D; i++) x[i] = a * x[i] + k * x0[i];
    }
    const lm_matrix ve = c->ve[l];
    if (ve.data != NULL)
        LM_TRY(lm_get_rows(ve.type, ve.data, c->n_vocab, c->KVD, c->tokens + r0, n,
                           c->ve_rows + r0 * c->KVD));
    return LM_OK;
}

static int nc_begin_chunk(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok) {
    nc_ctx *c = ctx;
    const int64_t D = c->D;
    c->tokens = tokens;
    LM_TRY(lm_rmsnorm_rows(b->pool, b->x, b->x, NULL, ntok, D, c->eps));
    if (c->smear_cols > 0) {
        /* the rows before the smear, in xb (free until the first block) */
        memcpy(b->xb, b->x, sizeof(float) * (size_t)(ntok * D));
        LM_TRY(nc_smear(c, b, b->xb));
    }
    if (c->resid != NULL) memcpy(c->x0, b->x, sizeof(float) * (size_t)(ntok * D));
    return nc_layer_input(c, b, 0, 0, ntok);
}

static int nc_after_block(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n) {
    nc_ctx *c = ctx;
    const int64_t D = c->D;
    float *x = b->x + r0 * D;
    if (layer == c->backout_layer)
        memcpy(c->xback + r0 * D, x, sizeof(float) * (size_t)(n * D));
    if (layer + 1 < c->n_layer) return nc_layer_input(c, b, layer + 1, r0, n);
    if (c->backout_layer >= 0) {
        const float k = c->backout_lambda[0];
        const float *xb = c->xback + r0 * D;
        for (int64_t i = 0; i < n * D; i++) x[i] -= k * xb[i];
    }
    return LM_OK;
}

/* The hooks' context for a model of config c and weights w, in m's arena. */
static int nc_ctx_new(lm_decoder_model *m, const nanochat_config *cfg,
                      const lm_decoder_tensors *t, const nanochat_weights *w, int64_t n_batch,
                      nc_ctx **out) {
    const lm_dims *d = &cfg->dims;
    lm_base *b = &m->base;
    nc_ctx *c = lm_base_alloc(b, sizeof *c);
    *out = c;
    if (c == NULL) return LM_ENOMEM;
    c->n_layer = d->n_layer;
    c->D = d->n_embd;
    c->KVD = (int64_t)d->n_kv_head * d->head_dim;
    c->n_vocab = d->n_vocab;
    c->eps = d->rms_eps;
    c->backout_layer = cfg->backout_layer;
    c->smear_cols = cfg->smear_cols;
    c->token_embd = t->io.token_embd;
    c->resid = w->resid_lambdas;
    c->x0l = w->x0_lambdas;
    c->smear_gate = w->smear_gate;
    c->smear_lambda = w->smear_lambda;
    c->backout_lambda = w->backout_lambda;
    c->cap = (int)n_batch;
    c->ve = lm_base_alloc(b, (size_t)d->n_layer * sizeof *c->ve);
    c->prev = lm_base_alloc(b, (size_t)n_batch * sizeof *c->prev);
    if (c->ve == NULL || c->prev == NULL) return LM_ENOMEM;
    if (c->resid != NULL) LM_TRY(lm_base_floats(b, n_batch * c->D, &c->x0));
    if (cfg->backout_layer >= 0) LM_TRY(lm_base_floats(b, n_batch * c->D, &c->xback));
    LM_TRY(lm_base_floats(b, n_batch * c->KVD, &c->ve_rows));
    LM_TRY(lm_base_floats(b, c->D, &c->row));
    for (int l = 0; l < d->n_layer; l++) c->ve[l] = w->layers[l].value_embd;
    return LM_OK;
}

int nanochat_build(const nanochat_config *config, const lm_decoder_tensors *tensors,
                   const nanochat_weights *weights, int n_threads, int64_t n_batch,
                   lm_base **out) {
    const nanochat_config *cfg = config;
    if (cfg == NULL || tensors == NULL || tensors->layers == NULL || weights == NULL ||
        weights->layers == NULL || cfg->windows == NULL || out == NULL || n_batch <= 0 ||
        n_batch > (1 << 20))
        return LM_EINVAL;
    const lm_dims *d = &cfg->dims;
    if (d->n_layer <= 0 || cfg->backout_layer < -1 || cfg->backout_layer >= d->n_layer ||
        (cfg->backout_layer >= 0 && weights->backout_lambda == NULL) || cfg->smear_cols < 0 ||
        cfg->smear_cols > d->n_embd ||
        (cfg->smear_cols > 0 && (weights->smear_gate == NULL || weights->smear_lambda == NULL)) ||
        ((weights->resid_lambdas == NULL) != (weights->x0_lambdas == NULL)))
        return LM_EINVAL;
    for (int l = 0; l < d->n_layer; l++) {
        const nanochat_layer *L = &weights->layers[l];
        if (cfg->windows[l] < 0) return LM_EINVAL;
        if (L->value_embd.data != NULL &&
            (lm_row_bytes(L->value_embd.type, (int64_t)d->n_kv_head * d->head_dim) <= 0 ||
             L->ve_gate == NULL))
            return LM_EINVAL;
    }
    lm_decoder_model *m;
    LM_TRY(lm_decoder_begin(d, tensors, 1.0f / sqrtf((float)d->head_dim), 0, &m));
    nc_ctx *c = NULL;
    int status = nc_ctx_new(m, cfg, tensors, weights, n_batch, &c);
    if (status == LM_OK) {
        const lm_hook hook = {c, nc_begin_chunk, nc_after_block, NULL};
        status = lm_decoder_add_hook(m, &hook);
    }
    if (status != LM_OK) {
        lm_model_free(&m->base);
        return status;
    }
    m->dec.logit_softcap = cfg->logit_softcap;
    for (int l = 0; l < d->n_layer; l++) {
        const nanochat_layer *L = &weights->layers[l];
        lm_block *b = &m->blocks[l];
        b->attn.window = cfg->windows[l];
        b->ffn = lm_dense_ffn(&tensors->layers[l].ffn, d->n_ff, LM_ACT_RELU2);
        if (L->value_embd.data != NULL) {
            b->attn.v_extra = c->ve_rows;
            b->attn.v_extra_stride = c->KVD;
            b->attn.v_gate = L->ve_gate;
            b->attn.v_gate_cols = cfg->ve_gate_cols;
            b->attn.v_gate_scale = cfg->ve_gate_scale;
        }
    }
    return lm_decoder_end(m, &tensors->io, d->rms_eps, d->n_vocab, d->n_embd, n_threads, n_batch,
                          out);
}
