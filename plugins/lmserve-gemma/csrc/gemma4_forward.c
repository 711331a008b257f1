/*
 * Forward pass of Gemma 4 (GGUF architecture gemma4) over the lmserve kit.
 *
 *   x = embed(tokens) * sqrt(n_embd)
 *   ple[l] = (rmsnorm(ple_model_proj . x / sqrt(n_embd)) * ple_proj_norm
 *             + ple_token_embd[token][l] * sqrt(n_embd_per_layer)) / sqrt(2)     (PLE models)
 *   per layer:
 *     h = rmsnorm(x) * attn_norm
 *     q = rope(rmsnorm_per_head(wq . h) * q_norm)
 *     k = rope(rmsnorm_per_head(wk . h) * k_norm),  v = rmsnorm_per_head(wv . h)   (no weight;
 *         wv absent: v from wk . h)
 *     x += rmsnorm(wo . attention(q, k, v)) * post_attn_norm          (attention scale 1)
 *     f = ffn(rmsnorm(x) * ffn_norm)                                  (GELU-tanh gated)
 *     MoE layers: f = rmsnorm(f) * post_ffn_norm_1
 *                   + rmsnorm(experts(rmsnorm(x) * pre_ffn_norm_2)) * post_ffn_norm_2
 *       router logits = router . (rmsnorm(x) / sqrt(n_embd) * router_scale), softmax over
 *       every expert, top n_expert_used renormalised to sum to 1, each expert's output times
 *       its down_exps_scale
 *     x += rmsnorm(f) * post_ffn_norm
 *     PLE: x += rmsnorm(proj . (gelu_tanh(inp_gate . x) * ple[l])) * ple_post_norm
 *     x *= out_scale
 *   logits = softcap(output . rmsnorm(x) * output_norm)
 *
 * Local layers attend over a sliding window with their own head width and RoPE; their cache
 * is a ring of the window and one chunk. The last layers may have no K/V of their own: they
 * attend to the cache of an earlier layer of their kind, and since they write no cache, a
 * chunk runs them only for the rows whose logits are asked for.
 */
#include "gemma_forward.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define G4_MAX_LAYERS 4096
#define G4_MAX_DIM (1 << 20)
#define G4_MAX_HEAD_DIM 1024 /* the widest head a ring cache attends over */
#define G4_MAX_EXPERTS 4096
#define G4_MAX_USED 64       /* experts per token */

typedef struct gemma4_model {
    lm_base base;              /* first: the kit drives the model through it */
    gemma4_config c;
    gemma4_layer *layers;      /* (n_layer) the weight table, fused q/k/v split */
    lm_cache_layer *geometry;  /* (n_layer) */
    lm_matrix token_embd;      /* (n_vocab, n_embd) */
    lm_matrix output;          /* (n_vocab, n_embd) */
    const float *output_norm;  /* (n_embd) */
    lm_matrix ple_token_embd;  /* (n_vocab, n_layer * n_embd_per_layer) */
    lm_matrix ple_model_proj;  /* (n_layer * n_embd_per_layer, n_embd) */
    const float *ple_proj_norm; /* (n_embd_per_layer) */
    lm_rotary rope;            /* global layers */
    lm_rotary rope_swa;        /* local layers */
    int first_shared;          /* first layer without K/V of its own; n_layer: none */
    float *xc;                 /* (n_batch, n_embd) the experts' branch */
    float *ple;                /* (n_batch, n_layer * n_embd_per_layer) the chunk's per-layer
                                  inputs; NULL without PLE */
} gemma4_model;

/* ============================================================================ scratch */

static float *g4_alloc(int64_t n) {
    const size_t bytes = ((size_t)n * sizeof(float) + 63) & ~(size_t)63;
    return aligned_alloc(64, bytes ? bytes : 64);
}

/* Carve 64-byte aligned arrays of the given float counts out of the base's scratch (one
 * call per helper: a later call reuses the same memory). */
static int g4_carve(lm_base *b, int n, float **out[], const int64_t *lens) {
    size_t total = 0;
    for (int i = 0; i < n; i++) total += ((size_t)lens[i] * sizeof(float) + 63) & ~(size_t)63;
    uint8_t *mem = lm_base_tmp(b, total ? total : 64);
    if (mem == NULL) return LM_ENOMEM;
    for (int i = 0; i < n; i++) {
        *out[i] = (float *)mem;
        mem += ((size_t)lens[i] * sizeof(float) + 63) & ~(size_t)63;
    }
    return LM_OK;
}

/* An lm_matrix `rows` rows into m (rows of `cols` elements). */
static lm_matrix g4_rows_from(lm_matrix m, int64_t rows, int64_t cols) {
    return lm_matrix_rows(m, rows, cols);
}

/* ============================================================================ attention */

static int g4_attention(gemma4_model *m, int layer, const float *x, int64_t r0, int64_t n,
                        float *y) {
    lm_base *b = &m->base;
    const gemma4_layer *L = &m->layers[layer];
    const int64_t D = b->n_embd, hd = L->head_dim;
    const int64_t QD = (int64_t)L->n_head * hd, KVD = (int64_t)L->n_kv_head * hd;
    const int own = L->kv_source == layer;
    const float eps = m->c.rms_eps;
    float *q, *att, *k, *v;
    float **bufs[] = {&q, &att, &k, &v};
    const int64_t lens[] = {n * QD, n * QD, own ? n * KVD : 0, own ? n * KVD : 0};
    LM_TRY(g4_carve(b, 4, bufs, lens));
    lm_pool *pool = b->pool;

    lm_mm mms[3];
    int n_mm = 0;
    mms[n_mm++] = (lm_mm){L->wq, QD, D, x, q};
    if (own) {
        mms[n_mm++] = (lm_mm){L->wk, KVD, D, x, k};
        if (L->wv.data != NULL) mms[n_mm++] = (lm_mm){L->wv, KVD, D, x, v};
    }
    LM_TRY(lm_matmuls(pool, mms, n_mm, n));
    LM_TRY(lm_rmsnorm_rows(pool, q, q, L->q_norm, n * L->n_head, hd, eps));
    if (own) {
        if (L->wv.data == NULL) memcpy(v, k, sizeof(float) * (size_t)(n * KVD));
        LM_TRY(lm_rmsnorm_rows(pool, k, k, L->k_norm, n * L->n_kv_head, hd, eps));
        LM_TRY(lm_rmsnorm_rows(pool, v, v, NULL, n * L->n_kv_head, hd, eps));
    }
    const lm_attn spec = {.n_head = L->n_head,
                          .n_kv_head = L->n_kv_head,
                          .head_dim = (int)hd,
                          .scale = 1.0f,
                          .window = L->swa ? m->c.n_swa : 0,
                          .rope = L->swa ? &m->rope_swa : &m->rope};
    LM_TRY(lm_attend(b, &spec, layer, L->kv_source, q, own ? k : NULL, own ? v : NULL, r0, n,
                     att));
    return lm_matmul(pool, L->wo.type, L->wo.data, D, QD, att, n, y);
}

/* ============================================================================ experts */

/* The experts of a layer: a softmax over every expert, the top K renormalised to sum to 1,
 * GELU-tanh gated. */
static lm_moe g4_experts(const gemma4_model *m, const gemma4_layer *L) {
    const lm_moe moe = {.router = L->router, .gate_exps = L->gate_exps, .up_exps = L->up_exps,
                        .gate_up_exps = L->gate_up_exps, .down_exps = L->down_exps,
                        .n_expert = m->c.n_expert, .n_used = m->c.n_expert_used,
                        .n_ff = L->n_ff_exp, .gating = LM_GATING_SOFTMAX, .norm_weights = 1,
                        .weights_scale = 1.0f, .act = LM_ACT_GELU_TANH};
    return moe;
}

/* One token's routing, each chosen weight times its expert's scale. */
static int g4_route(const gemma4_layer *L, const lm_moe *moe, float *logits, int32_t *ids,
                    float *w) {
    LM_TRY(lm_moe_route(moe, logits, ids, w));
    if (L->down_exps_scale != NULL)
        for (int k = 0; k < moe->n_used; k++) w[k] *= L->down_exps_scale[ids[k]];
    return LM_OK;
}

/* y (n, n_embd) = the routed experts of the layer over the rows h (n, n_embd) of the
 * residual after attention, rows row0.. of the chunk. y may not alias h. */
static int g4_moe(gemma4_model *m, int layer, const float *h, int64_t n, int64_t row0, float *y) {
    lm_base *b = &m->base;
    const gemma4_layer *L = &m->layers[layer];
    const lm_moe moe = g4_experts(m, L);
    const int64_t D = b->n_embd;
    const int E = moe.n_expert, K = moe.n_used;
    const int64_t NK = n * K; /* (token, choice) pairs */
    /* the routing first: lm_moe_experts keeps it and reuses the rest of the scratch */
    float *wts, *ids_f, *r, *logits;
    float **bufs[] = {&wts, &ids_f, &r, &logits};
    const int64_t lens[] = {NK, NK, n * D, n * E};
    LM_TRY(g4_carve(b, 4, bufs, lens));
    int32_t *ids = (int32_t *)ids_f;
    lm_pool *pool = b->pool;

    /* router: rmsnorm(h) / sqrt(n_embd) * router_scale */
    LM_TRY(lm_rmsnorm_rows(pool, r, h, L->router_scale, n, D, m->c.rms_eps));
    LM_TRY(lm_scale_rows(r, 1.0f / sqrtf((float)D), n * D));
    LM_TRY(lm_matmul(pool, L->router.type, L->router.data, E, D, r, n, logits));
    for (int64_t t = 0; t < n; t++)
        LM_TRY(g4_route(L, &moe, logits + t * E, ids + t * K, wts + t * K));
    lm_trace *tr = b->trace;
    if (tr != NULL && tr->n_used == K && b->trace_row + row0 + n <= tr->cap) {
        const size_t at =
            ((size_t)layer * (size_t)tr->cap + (size_t)(b->trace_row + row0)) * (size_t)K;
        memcpy(tr->ids + at, ids, sizeof(int32_t) * (size_t)NK);
        memcpy(tr->weights + at, wts, sizeof(float) * (size_t)NK);
    }

    /* the experts' input, into y while it is free */
    LM_TRY(lm_rmsnorm_rows(pool, y, h, L->pre_ffn_norm_2, n, D, m->c.rms_eps));
    return lm_moe_experts(b, &moe, y, n, ids, wts, y);
}

/* ============================================================================ layers */

/* The per-layer inputs of the chunk's tokens, from their embeddings (in base.x). */
static int g4_ple_inputs(gemma4_model *m, const int32_t *tokens, int64_t ntok) {
    lm_base *b = &m->base;
    const int64_t P = m->c.n_embd_per_layer, LP = (int64_t)m->c.n_layer * P, D = b->n_embd;
    float *tok;
    float **bufs[] = {&tok};
    const int64_t lens[] = {ntok * LP};
    LM_TRY(g4_carve(b, 1, bufs, lens));
    LM_TRY(lm_get_rows(m->ple_token_embd.type, m->ple_token_embd.data, b->n_vocab, LP, tokens,
                       ntok, tok));
    LM_TRY(lm_matmul(b->pool, m->ple_model_proj.type, m->ple_model_proj.data, LP, D, b->x, ntok,
                     m->ple));
    LM_TRY(lm_scale_rows(m->ple, 1.0f / sqrtf((float)D), ntok * LP));
    LM_TRY(lm_rmsnorm_rows(b->pool, m->ple, m->ple, m->ple_proj_norm, ntok * m->c.n_layer, P,
                           m->c.rms_eps));
    const float tok_scale = sqrtf((float)P), mix = 1.0f / sqrtf(2.0f);
    for (int64_t i = 0; i < ntok * LP; i++) m->ple[i] = (m->ple[i] + tok[i] * tok_scale) * mix;
    return LM_OK;
}

/* Layer `layer` over rows r0 .. r0 + n - 1 of the chunk. */
static int g4_layer(gemma4_model *m, int layer, int64_t r0, int64_t n) {
    lm_base *b = &m->base;
    const gemma4_layer *L = &m->layers[layer];
    const int64_t D = b->n_embd;
    const float eps = m->c.rms_eps;
    lm_pool *pool = b->pool;
    float *x = b->x + r0 * D, *xb = b->xb + r0 * D, *xc = m->xc + r0 * D;

    LM_TRY(lm_rmsnorm_rows(pool, xb, x, L->attn_norm, n, D, eps));
    LM_TRY(g4_attention(m, layer, xb, r0, n, xb));
    LM_TRY(lm_rmsnorm_rows(pool, xb, xb, L->post_attn_norm, n, D, eps));
    LM_TRY(lm_add_rows(x, xb, n * D));

    LM_TRY(lm_rmsnorm_rows(pool, xb, x, L->ffn_norm, n, D, eps));
    const lm_ffn ffn = {L->ffn_gate, L->ffn_up, L->ffn_down, L->n_ff, LM_ACT_GELU_TANH};
    LM_TRY(lm_glu_ffn(b, &ffn, xb, n, xb));
    if (L->router.data != NULL) {
        LM_TRY(lm_rmsnorm_rows(pool, xb, xb, L->post_ffn_norm_1, n, D, eps));
        LM_TRY(g4_moe(m, layer, x, n, r0, xc));
        LM_TRY(lm_rmsnorm_rows(pool, xc, xc, L->post_ffn_norm_2, n, D, eps));
        LM_TRY(lm_add_rows(xb, xc, n * D));
    }
    LM_TRY(lm_rmsnorm_rows(pool, xb, xb, L->post_ffn_norm, n, D, eps));
    LM_TRY(lm_add_rows(x, xb, n * D));

    if (m->ple != NULL) {
        const int64_t P = m->c.n_embd_per_layer, LP = (int64_t)m->c.n_layer * P;
        float *g;
        float **bufs[] = {&g};
        const int64_t lens[] = {n * P};
        LM_TRY(g4_carve(b, 1, bufs, lens));
        LM_TRY(lm_matmul(pool, L->inp_gate.type, L->inp_gate.data, P, D, x, n, g));
        for (int64_t t = 0; t < n; t++) {
            const float *in = m->ple + (r0 + t) * LP + (int64_t)layer * P;
            LM_TRY(lm_glu_rows(pool, g + t * P, g + t * P, in, P, LM_ACT_GELU_TANH));
        }
        LM_TRY(lm_matmul(pool, L->proj.type, L->proj.data, D, P, g, n, xb));
        LM_TRY(lm_rmsnorm_rows(pool, xb, xb, L->ple_post_norm, n, D, eps));
        LM_TRY(lm_add_rows(x, xb, n * D));
    }
    if (L->out_scale != NULL) LM_TRY(lm_scale_rows(x, L->out_scale[0], n * D));
    return LM_OK;
}

static int g4_chunk(void *self, const int32_t *tokens, int64_t ntok, float *logits,
                    int64_t first_logit) {
    gemma4_model *m = self;
    lm_base *b = &m->base;
    if (ntok < 0 || ntok > b->n_batch || first_logit < 0 || first_logit > ntok) return LM_EINVAL;
    const int64_t D = b->n_embd;
    LM_TRY(lm_embed(b, m->token_embd, tokens, ntok));
    LM_TRY(lm_scale_rows(b->x, sqrtf((float)D), ntok * D));
    if (m->ple != NULL) LM_TRY(g4_ple_inputs(m, tokens, ntok));
    for (int l = 0; l < m->c.n_layer; l++) {
        /* a layer without K/V of its own writes no cache: only rows with logits matter */
        const int64_t r0 = l >= m->first_shared ? first_logit : 0;
        if (r0 < ntok) LM_TRY(g4_layer(m, l, r0, ntok - r0));
    }
    return lm_logits(b, m->output_norm, m->c.rms_eps, m->output, b->x + first_logit * D,
                     ntok - first_logit, m->c.logit_softcap, logits);
}

/* ============================================================================ build */

static void g4_free(void *self) {
    gemma4_model *m = self;
    lm_base_free(&m->base);
    free(m->layers);
    free(m->geometry);
    free(m->xc);
    free(m->ple);
    free(m);
}

static int g4_rope_ok(const lm_rotary *r, int head_dim) {
    return (r->mode == LM_ROPE_NORMAL || r->mode == LM_ROPE_NEOX) && r->n_rot >= 0 &&
           r->n_rot <= head_dim && r->n_rot % 2 == 0 && (r->n_rot == 0 || r->inv_freq != NULL) &&
           isfinite(r->mscale);
}

/* Check one layer of the table (fused q/k/v already split) against the config. */
static int g4_layer_ok(const gemma4_model *m, int l) {
    const gemma4_config *c = &m->c;
    const gemma4_layer *L = &m->layers[l];
    const int64_t D = c->n_embd;
    if (L->n_head <= 0 || L->n_head > 4096 || L->n_kv_head <= 0 || L->n_kv_head > 4096 ||
        L->n_head % L->n_kv_head != 0 || L->head_dim <= 0 || L->head_dim > G4_MAX_HEAD_DIM ||
        L->n_ff <= 0 || L->n_ff > G4_MAX_DIM || (L->swa != 0 && L->swa != 1) ||
        (L->swa && c->n_swa <= 0) || L->kv_source < 0 || L->kv_source > l)
        return LM_EINVAL;
    if (!g4_rope_ok(L->swa ? &m->rope_swa : &m->rope, L->head_dim)) return LM_EINVAL;
    const int64_t QD = (int64_t)L->n_head * L->head_dim;
    if (L->attn_norm == NULL || L->q_norm == NULL || L->post_attn_norm == NULL ||
        L->ffn_norm == NULL || L->post_ffn_norm == NULL)
        return LM_EINVAL;
    if (!lm_matrix_ok(L->wq, D) || !lm_matrix_ok(L->wo, QD) || !lm_matrix_ok(L->ffn_gate, D) ||
        !lm_matrix_ok(L->ffn_up, D) || !lm_matrix_ok(L->ffn_down, L->n_ff))
        return LM_ETYPE;
    if (L->kv_source == l) {
        if (L->k_norm == NULL || l >= m->first_shared) return LM_EINVAL;
        if (!lm_matrix_ok(L->wk, D) || (L->wv.data != NULL && !lm_matrix_ok(L->wv, D)))
            return LM_ETYPE;
    } else {
        /* the source: an earlier layer of the same kind with its own cache of these heads */
        const gemma4_layer *S = &m->layers[L->kv_source];
        if (l < m->first_shared || S->kv_source != L->kv_source || S->swa != L->swa ||
            S->head_dim != L->head_dim || S->n_kv_head != L->n_kv_head)
            return LM_EINVAL;
    }
    if (L->router.data != NULL) {
        if (c->n_expert <= 0 || L->n_ff_exp <= 0 || L->n_ff_exp > G4_MAX_DIM ||
            L->router_scale == NULL || L->pre_ffn_norm_2 == NULL || L->post_ffn_norm_1 == NULL ||
            L->post_ffn_norm_2 == NULL)
            return LM_EINVAL;
        const int fused = L->gate_up_exps.data != NULL;
        if (!lm_matrix_ok(L->router, D) || !lm_matrix_ok(L->down_exps, L->n_ff_exp) ||
            (fused && !lm_matrix_ok(L->gate_up_exps, D)) ||
            (!fused && (!lm_matrix_ok(L->gate_exps, D) || !lm_matrix_ok(L->up_exps, D))))
            return LM_ETYPE;
    }
    if (c->n_embd_per_layer > 0) {
        if (L->ple_post_norm == NULL) return LM_EINVAL;
        if (!lm_matrix_ok(L->inp_gate, D) || !lm_matrix_ok(L->proj, c->n_embd_per_layer))
            return LM_ETYPE;
    }
    if (L->out_scale != NULL && !isfinite(L->out_scale[0])) return LM_EINVAL;
    return LM_OK;
}

static int g4_config_ok(const gemma4_config *c, const gemma4_weights *w) {
    if (c->n_layer <= 0 || c->n_layer > G4_MAX_LAYERS || c->n_embd <= 0 ||
        c->n_embd > G4_MAX_DIM || c->n_vocab <= 0 || c->n_vocab > (1 << 24) ||
        c->n_embd_per_layer < 0 || c->n_embd_per_layer > G4_MAX_DIM ||
        (int64_t)c->n_layer * c->n_embd_per_layer > G4_MAX_DIM || c->n_expert < 0 ||
        c->n_expert > G4_MAX_EXPERTS ||
        (c->n_expert > 0 && (c->n_expert_used <= 0 || c->n_expert_used > c->n_expert ||
                             c->n_expert_used > G4_MAX_USED)) ||
        c->n_swa < 0 || c->n_swa > ((int64_t)1 << 30) || !(c->rms_eps >= 0.0f) ||
        !(c->logit_softcap >= 0.0f) || !isfinite(c->logit_softcap))
        return LM_EINVAL;
    if (w->output_norm == NULL) return LM_EINVAL;
    if (!lm_matrix_ok(w->token_embd, c->n_embd) || !lm_matrix_ok(w->output, c->n_embd))
        return LM_ETYPE;
    if (c->n_embd_per_layer > 0) {
        if (w->ple_proj_norm == NULL) return LM_EINVAL;
        if (!lm_matrix_ok(w->ple_token_embd, (int64_t)c->n_layer * c->n_embd_per_layer) ||
            !lm_matrix_ok(w->ple_model_proj, c->n_embd))
            return LM_ETYPE;
    }
    return LM_OK;
}

int gemma4_build(const gemma4_config *config, const gemma4_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out) {
    if (out == NULL) return LM_EINVAL;
    *out = NULL;
    if (config == NULL || weights == NULL || weights->layers == NULL || n_batch <= 0 ||
        n_batch > (1 << 20))
        return LM_EINVAL;
    LM_TRY(g4_config_ok(config, weights));
    const gemma4_config *c = config;
    gemma4_model *m = calloc(1, sizeof *m);
    if (m == NULL) return LM_ENOMEM;
    m->c = *c;
    m->token_embd = weights->token_embd;
    m->output = weights->output;
    m->output_norm = weights->output_norm;
    m->ple_token_embd = weights->ple_token_embd;
    m->ple_model_proj = weights->ple_model_proj;
    m->ple_proj_norm = weights->ple_proj_norm;
    m->rope = weights->rope;
    m->rope_swa = weights->rope_swa;
    m->layers = malloc(sizeof *m->layers * (size_t)c->n_layer);
    m->geometry = calloc((size_t)c->n_layer, sizeof *m->geometry);
    int status = m->layers != NULL && m->geometry != NULL ? LM_OK : LM_ENOMEM;
    if (status == LM_OK) memcpy(m->layers, weights->layers, sizeof *m->layers * (size_t)c->n_layer);

    /* layers with their own K/V come first; the rest attend to earlier caches */
    m->first_shared = c->n_layer;
    for (int l = 0; status == LM_OK && l < c->n_layer; l++) {
        if (m->layers[l].kv_source != l) {
            m->first_shared = l;
            break;
        }
    }
    for (int l = 0; status == LM_OK && l < c->n_layer; l++) {
        gemma4_layer *L = &m->layers[l];
        if (L->wqkv.data != NULL) {
            /* fused rows: q, then k, then v */
            if (L->n_head <= 0 || L->n_kv_head <= 0 || L->head_dim <= 0 ||
                !lm_matrix_ok(L->wqkv, c->n_embd)) {
                status = LM_EINVAL;
                break;
            }
            const int64_t QD = (int64_t)L->n_head * L->head_dim;
            const int64_t KVD = (int64_t)L->n_kv_head * L->head_dim;
            L->wq = (lm_matrix){L->wqkv.data, L->wqkv.type};
            L->wk = g4_rows_from(L->wqkv, QD, c->n_embd);
            L->wv = g4_rows_from(L->wqkv, QD + KVD, c->n_embd);
        }
        status = g4_layer_ok(m, l);
        const int own = L->kv_source == l;
        const int64_t ring = L->swa ? c->n_swa + n_batch : 0;
        /* a layer attending to another's cache keeps a token row: its geometry (and ring)
         * only has to match from cache to cache */
        m->geometry[l] = own ? (lm_cache_layer){L->n_kv_head, L->head_dim, L->head_dim, ring}
                             : (lm_cache_layer){1, 1, 1, ring};
    }
    if (status == LM_OK) {
        status = lm_base_init(&m->base, n_threads, n_batch, c->n_vocab, c->n_embd, c->n_layer,
                              m->geometry, g4_chunk, g4_free);
    }
    if (status == LM_OK) {
        m->xc = g4_alloc(n_batch * c->n_embd);
        if (c->n_embd_per_layer > 0)
            m->ple = g4_alloc(n_batch * c->n_layer * (int64_t)c->n_embd_per_layer);
        if (m->xc == NULL || (c->n_embd_per_layer > 0 && m->ple == NULL)) status = LM_ENOMEM;
    }
    if (status != LM_OK) {
        g4_free(m);
        return status;
    }
    *out = &m->base;
    return LM_OK;
}
