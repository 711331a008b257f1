/*
 * Forward pass of Inkling over the lmserve kit (see inkling_forward.h): a chunk function of
 * its own over the kit's layer helpers, since its blocks are no pre-norm decoder blocks (the
 * convolutions on k, v and both branches, the bias by distance, the router).
 */
#include "inkling_forward.h"

#include <math.h>
#include <string.h>

/* The model and everything it points to that is not a weight lie in its arena
 * (lm_model_new, lm_base_alloc): lm_model_free frees them. */
typedef struct ink_model {
    lm_base base; /* first: the kit drives the model through it */
    inkling_config c;
    lm_io_tensors io;
    const float *embd_norm;
    inkling_layer *layers;   /* (n_layer) */
    lm_cache_layer *geometry; /* (n_layer) */
    lm_ffn *dense;           /* (n_layer) */
    lm_moe *routed, *shared; /* (n_layer) */
    int64_t *state_off;      /* (n_layer, 4) the convolutions' offsets in a layer's state */
    /* scratch, n_batch rows each */
    float *q, *k, *v, *r, *bias, *att, *mo, *rl, *w, *sw, *conv;
    int32_t *ids, *sids;
} ink_model;

/* n_floats floats of the model's arena (at least one), as `float *` or `int32_t *`. */
static void *ink_alloc(ink_model *m, int64_t n_floats) {
    return lm_base_alloc(&m->base, sizeof(float) * (size_t)(n_floats > 0 ? n_floats : 1));
}

/* dst (S rows of C) = the last S inputs after the first t rows xs of a chunk that continues
 * from the state st (S rows). */
static void ink_last_inputs(float *dst, const float *xs, const float *st, int64_t t, int S,
                            int64_t C) {
    for (int j = 0; j < S; j++) {
        const int64_t i = t - S + j; /* input index, < 0 in the old state */
        memcpy(dst + (int64_t)j * C, i >= 0 ? xs + i * C : st + (S + i) * C,
               sizeof(float) * (size_t)C);
    }
}

/* x (rows of the chunk, C channels) = x + causal depthwise conv of x, kernel w (C, K), each
 * sequence's rows continuing from its state at `off` in the layer's state (the last K - 1
 * inputs, time-major), which they then replace; so does each snapshot planned inside the
 * rows (lm_cache_plan_snapshots). */
static int ink_sconv(ink_model *m, int layer, float *x, int64_t C, const float *w, int64_t off) {
    const lm_base *b = &m->base;
    const int K = m->c.conv_kernel, S = K - 1;
    float *next = m->conv;
    int64_t row0 = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const lm_seq *sq = &b->seqs[s];
        float *st = lm_cache_layer_state(sq->cache, layer);
        if (st == NULL) return LM_EINVAL;
        st += off;
        float *xs = x + row0 * C;
        const int64_t n = sq->ntok;
        row0 += n;
        ink_last_inputs(next, xs, st, n, S, C); /* the new state */
        for (int64_t t = 1; t < n; t++) { /* a checkpoint after t rows */
            float *kept = lm_cache_snapshot_layer(sq->cache, sq->pos + t, layer);
            if (kept != NULL) ink_last_inputs(kept + off, xs, st, t, S, C);
        }
        /* outputs from the last row down: a row's inputs are itself and earlier rows */
        for (int64_t t = n - 1; t >= 0; t--) {
            float *y = xs + t * C;
            for (int64_t ch = 0; ch < C; ch++) {
                const float *wc = w + ch * K;
                float acc = 0.0f;
                for (int j = 0; j < K; j++) {
                    const int64_t i = t - S + j;
                    acc += wc[j] * (i >= 0 ? xs[i * C + ch] : st[(S + i) * C + ch]);
                }
                y[ch] += acc;
            }
        }
        memcpy(st, next, sizeof(float) * (size_t)(S * C));
    }
    return LM_OK;
}

static float ink_logsigmoid(float x) {
    return x >= 0.0f ? -log1pf(expf(-x)) : x - log1pf(expf(x));
}

/* The routing of one token: its top-k routed experts by sigmoid(logit) + bias, and the
 * weights of those and of the shared experts: a softmax of their logsigmoids, times scale. */
static void ink_route(const ink_model *m, const inkling_layer *L, const float *logits,
                      float scale, int32_t *ids, float *w, float *sw) {
    const int E = m->c.n_expert, K = m->c.n_expert_used, S = m->c.n_shared;
    float best[64];
    for (int k = 0; k < K; k++) {
        ids[k] = -1;
        best[k] = -INFINITY;
    }
    for (int e = 0; e < E; e++) {
        const float s = 1.0f / (1.0f + expf(-logits[e])) + L->router_bias[e];
        if (s <= best[K - 1] && ids[K - 1] >= 0) continue;
        int k = K - 1;
        while (k > 0 && (s > best[k - 1] || ids[k - 1] < 0)) {
            best[k] = best[k - 1];
            ids[k] = ids[k - 1];
            k--;
        }
        best[k] = s;
        ids[k] = e;
    }
    float ls[128], mx = -INFINITY, sum = 0.0f;
    for (int k = 0; k < K + S; k++) {
        ls[k] = ink_logsigmoid(k < K ? logits[ids[k]] : logits[E + k - K]);
        mx = ls[k] > mx ? ls[k] : mx;
    }
    for (int k = 0; k < K + S; k++) sum += (ls[k] = expf(ls[k] - mx));
    for (int k = 0; k < K + S; k++) {
        const float p = ls[k] / sum * scale;
        if (k < K) w[k] = p;
        else sw[k - K] = p;
    }
}

/* y (n, D) = the MLP of layer L over xb (n, D), times its gscale. */
static int ink_mlp(ink_model *m, int l, const float *xb, int64_t n, float *y) {
    lm_base *b = &m->base;
    const inkling_layer *L = &m->layers[l];
    const int64_t D = b->n_embd;
    const float g = L->gscale[0];
    if (l < m->c.n_dense) {
        LM_TRY(lm_glu_ffn(b, &m->dense[l], xb, n, y));
        return lm_scale_rows(y, g, n * D);
    }
    const int E = m->c.n_expert, K = m->c.n_expert_used, S = m->c.n_shared;
    LM_TRY(lm_matmul(b->pool, L->router.type, L->router.data, E + S, D, xb, n, m->rl));
    for (int64_t t = 0; t < n; t++) {
        ink_route(m, L, m->rl + t * (E + S), m->c.route_scale * g, m->ids + t * K, m->w + t * K,
                  m->sw + t * S);
        for (int s = 0; s < S; s++) m->sids[t * S + s] = s;
    }
    /* the shared experts first: y may be xb */
    LM_TRY(lm_moe_experts(b, &m->shared[l], xb, n, m->sids, m->sw, m->mo));
    LM_TRY(lm_moe_experts(b, &m->routed[l], xb, n, m->ids, m->w, y));
    return lm_add_rows(y, m->mo, n * D);
}

static int ink_attention(ink_model *m, int l, const float *xb, int64_t n, float *y) {
    lm_base *b = &m->base;
    const inkling_layer *L = &m->layers[l];
    const inkling_config *c = &m->c;
    const int64_t D = b->n_embd, H = c->dims.n_head, HD = c->dims.head_dim, R = c->d_rel;
    const int64_t QD = H * HD, KVD = (int64_t)L->n_kv_head * HD;
    const int64_t X = L->swa ? c->rel_extent_swa : c->rel_extent;
    const lm_mm mms[4] = {{L->wq, QD, D, xb, m->q}, {L->wk, KVD, D, xb, m->k},
                          {L->wv, KVD, D, xb, m->v}, {L->wr, H * R, D, xb, m->r}};
    LM_TRY(lm_matmuls(b->pool, mms, 4, n));
    LM_TRY(ink_sconv(m, l, m->k, KVD, L->conv_k, m->state_off[4 * l]));
    LM_TRY(ink_sconv(m, l, m->v, KVD, L->conv_v, m->state_off[4 * l + 1]));
    LM_TRY(lm_rmsnorm_rows(b->pool, m->q, m->q, L->q_norm, n * H, HD, c->dims.rms_eps));
    LM_TRY(lm_rmsnorm_rows(b->pool, m->k, m->k, L->k_norm, n * L->n_kv_head, HD,
                           c->dims.rms_eps));
    /* bias[t, h, d] = r[t, h] . rel_proj[:, d] */
    LM_TRY(lm_matmul(b->pool, LM_F32, L->rel_proj_t, X, R, m->r, n * H, m->bias));
    int64_t row0 = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        const lm_seq *sq = &b->seqs[s];
        const int64_t r0 = row0, cnt = sq->ntok;
        row0 += cnt;
        if (!L->swa && c->log_n_floor > 0)
            for (int64_t t = 0; t < cnt; t++) {
                const float eff = (float)(sq->pos + t + 1) / (float)c->log_n_floor;
                const float tau = 1.0f + c->log_alpha * logf(eff > 1.0f ? eff : 1.0f);
                LM_TRY(lm_scale_rows(m->q + (r0 + t) * QD, tau, QD));
                LM_TRY(lm_scale_rows(m->bias + (r0 + t) * H * X, tau, H * X));
            }
        LM_TRY(lm_cache_write(sq->cache, l, sq->pos, cnt, m->k + r0 * KVD, m->v + r0 * KVD));
        LM_TRY(lm_attention_cached_bias(b->pool, m->q + r0 * QD, sq->cache, l,
                                        m->att + r0 * QD, cnt, sq->pos, (int)H,
                                        1.0f / (float)HD, L->swa ? c->window : 0, 0.0f,
                                        m->bias + r0 * H * X, X));
    }
    if (row0 != n) return LM_EINVAL;
    return lm_matmul(b->pool, L->wo.type, L->wo.data, D, QD, m->att, n, y);
}

static int ink_chunk(void *self, const int32_t *tokens, int64_t ntok, float *logits,
                     int64_t first_logit) {
    ink_model *m = self;
    lm_base *b = &m->base;
    const inkling_config *c = &m->c;
    const int64_t D = b->n_embd;
    const float eps = c->dims.rms_eps;
    if (first_logit < 0 || first_logit > ntok) return LM_EINVAL;
    LM_TRY(lm_embed(b, m->io.token_embd, tokens, ntok));
    LM_TRY(lm_rmsnorm_rows(b->pool, b->x, b->x, m->embd_norm, ntok, D, eps));
    for (int l = 0; l < b->n_layer; l++) {
        const inkling_layer *L = &m->layers[l];
        LM_TRY(lm_rmsnorm_rows(b->pool, b->xb, b->x, L->attn_norm, ntok, D, eps));
        LM_TRY(ink_attention(m, l, b->xb, ntok, m->mo));
        LM_TRY(ink_sconv(m, l, m->mo, D, L->conv_attn, m->state_off[4 * l + 2]));
        LM_TRY(lm_add_rows(b->x, m->mo, ntok * D));
        LM_TRY(lm_rmsnorm_rows(b->pool, b->xb, b->x, L->ffn_norm, ntok, D, eps));
        LM_TRY(ink_mlp(m, l, b->xb, ntok, b->xb));
        LM_TRY(ink_sconv(m, l, b->xb, D, L->conv_mlp, m->state_off[4 * l + 3]));
        LM_TRY(lm_add_rows(b->x, b->xb, ntok * D));
    }
    const int64_t n = ntok - first_logit, V = b->n_vocab;
    LM_TRY(lm_logits(b, m->io.output_norm, eps, m->io.output, b->x + first_logit * D, n, 0.0f,
                     logits));
    return lm_scale_rows(logits, c->logit_scale, n * V);
}

static int ink_check(const inkling_config *c, const inkling_weights *w) {
    const lm_dims *d = &c->dims;
    if (d->n_layer <= 0 || d->n_embd <= 0 || d->n_head <= 0 || d->head_dim <= 0 ||
        c->d_rel <= 0 || c->rel_extent <= 0 || c->rel_extent_swa <= 0 || c->window <= 0 ||
        c->conv_kernel < 2 || c->n_dense < 0 || c->n_dense > d->n_layer ||
        c->n_vocab_unpadded <= 0 || c->n_vocab_unpadded > d->n_vocab ||
        w->token_embd_norm == NULL || w->io.output.data == NULL || w->io.output_norm == NULL)
        return LM_EINVAL;
    if (c->n_dense < d->n_layer &&
        (c->n_expert <= 0 || c->n_expert_used <= 0 || c->n_expert_used > c->n_expert ||
         c->n_expert_used > 64 || c->n_shared <= 0 || c->n_expert_used + c->n_shared > 128 ||
         c->n_ff_exp <= 0))
        return LM_EINVAL;
    for (int l = 0; l < d->n_layer; l++) {
        const inkling_layer *L = &w->layers[l];
        if (L->n_kv_head <= 0 || d->n_head % L->n_kv_head || L->attn_norm == NULL ||
            L->ffn_norm == NULL || L->q_norm == NULL || L->k_norm == NULL ||
            L->rel_proj_t == NULL || L->conv_k == NULL || L->conv_v == NULL ||
            L->conv_attn == NULL || L->conv_mlp == NULL || L->gscale == NULL ||
            L->wq.data == NULL || L->wk.data == NULL || L->wv.data == NULL ||
            L->wr.data == NULL || L->wo.data == NULL)
            return LM_EINVAL;
        if (l < c->n_dense ? L->ffn_gate.data == NULL || L->ffn_up.data == NULL ||
                                 L->ffn_down.data == NULL
                           : L->router.data == NULL || L->router_bias == NULL ||
                                 L->gate_exps.data == NULL || L->up_exps.data == NULL ||
                                 L->down_exps.data == NULL || L->gate_shexp.data == NULL ||
                                 L->up_shexp.data == NULL || L->down_shexp.data == NULL)
            return LM_EINVAL;
    }
    return LM_OK;
}

int inkling_build(const inkling_config *config, const inkling_weights *weights, int n_threads,
                  int64_t n_batch, lm_base **out) {
    if (config == NULL || weights == NULL || weights->layers == NULL || out == NULL)
        return LM_EINVAL;
    LM_TRY(ink_check(config, weights));
    const inkling_config *c = config;
    const int NL = c->dims.n_layer;
    const int64_t D = c->dims.n_embd, H = c->dims.n_head, HD = c->dims.head_dim;
    const int64_t S = c->conv_kernel - 1;
    lm_base *base;
    LM_TRY(lm_model_new(sizeof(ink_model), &base));
    ink_model *m = (ink_model *)base;
    m->c = *c;
    m->io = weights->io;
    m->embd_norm = weights->token_embd_norm;
    m->layers = lm_base_alloc(base, (size_t)NL * sizeof *m->layers);
    m->geometry = lm_base_alloc(base, (size_t)NL * sizeof *m->geometry);
    m->dense = lm_base_alloc(base, (size_t)NL * sizeof *m->dense);
    m->routed = lm_base_alloc(base, (size_t)NL * sizeof *m->routed);
    m->shared = lm_base_alloc(base, (size_t)NL * sizeof *m->shared);
    m->state_off = lm_base_alloc(base, (size_t)NL * 4 * sizeof *m->state_off);
    if (m->layers == NULL || m->geometry == NULL || m->dense == NULL || m->routed == NULL ||
        m->shared == NULL || m->state_off == NULL) {
        lm_model_free(base);
        return LM_ENOMEM;
    }
    int64_t kvd_max = 0, x_max = c->rel_extent > c->rel_extent_swa ? c->rel_extent
                                                                     : c->rel_extent_swa;
    for (int l = 0; l < NL; l++) {
        const inkling_layer *L = &weights->layers[l];
        m->layers[l] = *L;
        const int64_t KVD = (int64_t)L->n_kv_head * HD;
        kvd_max = KVD > kvd_max ? KVD : kvd_max;
        /* full rows for the sliding layers too: a checkpoint of the convolutions' state may
         * be resumed from any earlier position */
        m->geometry[l] = (lm_cache_layer){L->n_kv_head, (int)HD, (int)HD, 0,
                                          S * (2 * KVD + 2 * D)};
        int64_t *o = m->state_off + 4 * l;
        o[0] = 0;
        o[1] = S * KVD;
        o[2] = 2 * S * KVD;
        o[3] = 2 * S * KVD + S * D;
        if (l < c->n_dense) {
            m->dense[l] = (lm_ffn){L->ffn_gate, L->ffn_up, L->ffn_down, c->dims.n_ff, LM_ACT_SILU};
        } else {
            m->routed[l] = (lm_moe){
                .router = L->router, .gate_exps = L->gate_exps, .up_exps = L->up_exps,
                .down_exps = L->down_exps, .n_expert = c->n_expert, .n_used = c->n_expert_used,
                .n_ff = c->n_ff_exp, .gating = LM_GATING_SIGMOID, .weights_scale = 1.0f,
                .act = LM_ACT_SILU,
            };
            m->shared[l] = (lm_moe){
                .router = L->router, .gate_exps = L->gate_shexp, .up_exps = L->up_shexp,
                .down_exps = L->down_shexp, .n_expert = c->n_shared, .n_used = c->n_shared,
                .n_ff = c->n_ff_exp, .gating = LM_GATING_SIGMOID, .weights_scale = 1.0f,
                .act = LM_ACT_SILU,
            };
        }
    }
    /* the padded rows of the vocabulary are neither read nor scored */
    const int rc = lm_base_init(base, n_threads, n_batch, c->n_vocab_unpadded, D, NL,
                                m->geometry, ink_chunk, NULL);
    if (rc != LM_OK) {
        lm_model_free(base);
        return rc;
    }
    const int64_t ES = c->n_expert + c->n_shared;
    m->q = ink_alloc(m, n_batch * H * HD);
    m->k = ink_alloc(m, n_batch * kvd_max);
    m->v = ink_alloc(m, n_batch * kvd_max);
    m->r = ink_alloc(m, n_batch * H * c->d_rel);
    m->bias = ink_alloc(m, n_batch * H * x_max);
    m->att = ink_alloc(m, n_batch * H * HD);
    m->mo = ink_alloc(m, n_batch * D);
    m->rl = ink_alloc(m, n_batch * ES);
    m->w = ink_alloc(m, n_batch * c->n_expert_used);
    m->sw = ink_alloc(m, n_batch * c->n_shared);
    m->conv = ink_alloc(m, S * (kvd_max > D ? kvd_max : D));
    m->ids = ink_alloc(m, n_batch * c->n_expert_used);
    m->sids = ink_alloc(m, n_batch * c->n_shared);
    if (m->q == NULL || m->k == NULL || m->v == NULL || m->r == NULL || m->bias == NULL ||
        m->att == NULL || m->mo == NULL || m->rl == NULL || m->w == NULL || m->sw == NULL ||
        m->conv == NULL || m->ids == NULL || m->sids == NULL) {
        lm_model_free(base);
        return LM_ENOMEM;
    }
    *out = base;
    return LM_OK;
}
