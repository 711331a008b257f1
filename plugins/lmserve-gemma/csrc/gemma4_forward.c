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
 * attend to the cache of an earlier layer of their kind. The kit's decoder loop runs all of
 * it as block data (per-layer heads, windows and RoPE, the value norm, shared caches, the
 * experts beside the dense feed-forward, the output scale): this file maps the weight table
 * onto blocks, and adds the per-layer inputs and DiffusionGemma's passes through two hooks of
 * the decoder, which compose: the canvas embedding is what the per-layer inputs are projected
 * from, and a pass's layer scalar multiplies a layer's output after its per-layer input.
 */
#include "gemma_forward.h"

#include <math.h>

/* What the PLE hooks read and the chunk's inputs they write; all in the model's arena. */
typedef struct g4_ple_layer {
    lm_matrix inp_gate;      /* (P, n_embd) */
    lm_matrix proj;          /* (n_embd, P) */
    const float *post_norm;  /* (n_embd) */
} g4_ple_layer;

typedef struct g4_ple {
    lm_matrix token_embd;    /* (n_vocab, n_layer * P) */
    lm_matrix model_proj;    /* (n_layer * P, n_embd) */
    const float *proj_norm;  /* (P) */
    int n_layer;
    int64_t P;               /* n_embd_per_layer */
    float eps;
    float *rows;             /* (n_batch, n_layer * P) the chunk's per-layer inputs */
    g4_ple_layer layers[];   /* (n_layer) */
} g4_ple;

/* begin_chunk: the per-layer inputs of the chunk's tokens, from their embeddings (b->x). */
static int g4_ple_inputs(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok) {
    const g4_ple *p = ctx;
    const int64_t P = p->P, LP = p->n_layer * P, D = b->n_embd;
    float *ple = p->rows, *tok = lm_base_tmp(b, sizeof(float) * (size_t)(ntok * LP));
    if (tok == NULL) return LM_ENOMEM;
    LM_TRY(lm_get_rows(p->token_embd.type, p->token_embd.data, b->n_vocab, LP, tokens, ntok,
                       tok));
    LM_TRY(lm_matmul(b->pool, p->model_proj.type, p->model_proj.data, LP, D, b->x, ntok, ple));
    LM_TRY(lm_scale_rows(ple, 1.0f / sqrtf((float)D), ntok * LP));
    LM_TRY(lm_rmsnorm_rows(b->pool, ple, ple, p->proj_norm, ntok * p->n_layer, P, p->eps));
    const float tok_scale = sqrtf((float)P), mix = 1.0f / sqrtf(2.0f);
    for (int64_t i = 0; i < ntok * LP; i++) ple[i] = (ple[i] + tok[i] * tok_scale) * mix;
    return LM_OK;
}

/* after_block: the layer's per-layer input added to rows r0 .. r0 + n - 1. */
static int g4_ple_add(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n) {
    const g4_ple *p = ctx;
    const g4_ple_layer *L = &p->layers[layer];
    const int64_t P = p->P, LP = p->n_layer * P, D = b->n_embd;
    float *x = b->x + r0 * D, *xb = b->xb + r0 * D;
    float *g = lm_base_tmp(b, sizeof(float) * (size_t)(n * P));
    if (g == NULL) return LM_ENOMEM;
    LM_TRY(lm_matmul(b->pool, L->inp_gate.type, L->inp_gate.data, P, D, x, n, g));
    for (int64_t t = 0; t < n; t++) {
        const float *in = p->rows + (r0 + t) * LP + (int64_t)layer * P;
        LM_TRY(lm_glu_rows(b->pool, g + t * P, g + t * P, in, P, LM_ACT_GELU_TANH));
    }
    LM_TRY(lm_matmul(b->pool, L->proj.type, L->proj.data, D, P, g, n, xb));
    LM_TRY(lm_rmsnorm_rows(b->pool, xb, xb, L->post_norm, n, D, p->eps));
    return lm_add_rows(x, xb, n * D);
}

/* The PLE hooks on m, their weights checked (the kit sees none of them). */
static int g4_ple_hook(lm_decoder_model *m, const gemma4_config *c, const gemma4_weights *w,
                       int64_t n_batch) {
    const int64_t P = c->n_embd_per_layer, D = c->n_embd;
    if (!lm_matrix_ok(w->ple_token_embd, c->n_layer * P) || !lm_matrix_ok(w->ple_model_proj, D))
        return LM_ETYPE;
    if (w->ple_proj_norm == NULL) return LM_EINVAL;
    for (int l = 0; l < c->n_layer; l++) {
        const gemma4_layer *L = &w->layers[l];
        if (!lm_matrix_ok(L->inp_gate, D) || !lm_matrix_ok(L->proj, P)) return LM_ETYPE;
        if (L->ple_post_norm == NULL) return LM_EINVAL;
    }
    g4_ple *p = lm_base_alloc(&m->base, sizeof *p + sizeof p->layers[0] * (size_t)c->n_layer);
    if (p == NULL) return LM_ENOMEM;
    *p = (g4_ple){w->ple_token_embd, w->ple_model_proj, w->ple_proj_norm, c->n_layer, P,
                  c->rms_eps, NULL};
    LM_TRY(lm_base_floats(&m->base, n_batch * c->n_layer * P, &p->rows));
    for (int l = 0; l < c->n_layer; l++) {
        const gemma4_layer *L = &w->layers[l];
        p->layers[l] = (g4_ple_layer){L->inp_gate, L->proj, L->ple_post_norm};
    }
    const lm_hook hook = {p, g4_ple_inputs, g4_ple_add, NULL};
    return lm_decoder_add_hook(m, &hook);
}

/* DiffusionGemma: the canvas embedding and the two passes' layer scalars (the hooks' ctx). */
typedef struct g4_diffusion {
    const float *pre_norm;   /* (n_embd) */
    lm_matrix gate, up;      /* (n_ff, n_embd) */
    lm_matrix down;          /* (n_embd, n_ff) */
    int64_t n_ff;
    float eps;
    const float *soft;       /* (n_soft, n_embd) for the next bidirectional pass, or NULL */
    int64_t n_soft;
    int n_layer;
    const float **scales;    /* (2 * n_layer): causal pass's, then the canvas pass's; or NULL */
} g4_diffusion;

static int g4_canvas_pass(const lm_base *b) {
    return b->n_seqs == 1 && b->seqs[0].bidirectional;
}

/* begin_chunk: a canvas's embeddings e become rmsnorm(e + self-conditioning signal). */
static int g4_canvas_embed(void *ctx, lm_base *b, const int32_t *tokens, int64_t ntok) {
    (void)tokens;
    g4_diffusion *d = ctx;
    if (!g4_canvas_pass(b)) return LM_OK;
    const int64_t D = b->n_embd, F = d->n_ff;
    if (d->soft != NULL) {
        if (d->n_soft != ntok) return LM_EINVAL;
        float *h = lm_base_tmp(b, sizeof(float) * (size_t)(ntok * (D + 2 * F)));
        if (h == NULL) return LM_ENOMEM;
        float *g = h + ntok * D, *u = g + ntok * F;
        LM_TRY(lm_rmsnorm_rows(b->pool, h, d->soft, d->pre_norm, ntok, D, d->eps));
        const lm_mm gu[2] = {{d->gate, F, D, h, g}, {d->up, F, D, h, u}};
        LM_TRY(lm_matmuls(b->pool, gu, 2, ntok));
        LM_TRY(lm_glu_rows(b->pool, g, g, u, ntok * F, LM_ACT_GELU_TANH));
        LM_TRY(lm_matmul(b->pool, d->down.type, d->down.data, D, F, g, ntok, b->xb));
        LM_TRY(lm_add_rows(b->x, b->xb, ntok * D));
    }
    d->soft = NULL; /* one pass's */
    d->n_soft = 0;
    return lm_rmsnorm_rows(b->pool, b->x, b->x, NULL, ntok, D, d->eps);
}

/* after_block: the layer's output times the scalar of the pass's kind. */
static int g4_pass_scale(void *ctx, lm_base *b, int layer, int64_t r0, int64_t n) {
    const g4_diffusion *d = ctx;
    const float *s = d->scales[(g4_canvas_pass(b) ? d->n_layer : 0) + layer];
    return s != NULL ? lm_scale_rows(b->x + r0 * b->n_embd, s[0], n * b->n_embd) : LM_OK;
}

/* The diffusion hooks on m, their weights checked; the blocks' out_scale is theirs. */
static int g4_diffusion_hook(lm_decoder_model *m, const gemma4_config *c,
                             const gemma4_weights *w) {
    if (!lm_matrix_ok(w->sc_gate, c->n_embd) || !lm_matrix_ok(w->sc_up, c->n_embd) ||
        !lm_matrix_ok(w->sc_down, w->sc_n_ff) || w->sc_n_ff <= 0)
        return LM_ETYPE;
    for (int l = 0; l < c->n_layer; l++) {
        const gemma4_layer *L = &w->layers[l];
        if ((L->out_scale != NULL && !isfinite(L->out_scale[0])) ||
            (L->enc_out_scale != NULL && !isfinite(L->enc_out_scale[0])))
            return LM_EINVAL;
    }
    g4_diffusion *d = lm_base_alloc(&m->base, sizeof *d);
    const float **scales = lm_base_alloc(&m->base, 2 * (size_t)c->n_layer * sizeof *scales);
    if (d == NULL || scales == NULL) return LM_ENOMEM;
    *d = (g4_diffusion){w->sc_pre_norm, w->sc_gate, w->sc_up, w->sc_down, w->sc_n_ff,
                        c->rms_eps, NULL, 0, c->n_layer, scales};
    for (int l = 0; l < c->n_layer; l++) {
        const gemma4_layer *L = &w->layers[l];
        scales[l] = L->enc_out_scale;
        scales[c->n_layer + l] = L->out_scale;
        m->blocks[l].out_scale = NULL; /* the hook's, by pass */
    }
    const lm_hook hook = {d, g4_canvas_embed, g4_pass_scale, NULL};
    return lm_decoder_add_hook(m, &hook);
}

int gemma4_self_condition(lm_base *b, const float *soft, int64_t n) {
    g4_diffusion *d = lm_decoder_hook_ctx(b, g4_canvas_embed, g4_pass_scale);
    if (d == NULL || n < 0 || (soft == NULL) != (n == 0)) return LM_EINVAL;
    d->soft = soft;
    d->n_soft = n;
    return LM_OK;
}

/* Layer l of the tables as a block of the kit's decoder. */
static void g4_block(lm_decoder_model *m, const gemma4_config *c, const lm_layer_tensors *T,
                     const gemma4_layer *L, int l) {
    lm_block *b = &m->blocks[l];
    lm_block_norms(b, &T->attn, &T->ffn, c->rms_eps);
    b->attn = lm_block_attn(&T->attn, L->n_head, L->n_kv_head, L->head_dim, 1.0f, c->rms_eps,
                            T->swa ? &m->rope_swa : &m->rope, c->n_embd);
    b->attn.window = T->swa ? c->n_swa : 0;
    b->attn.v_norm = 1;
    b->attn.kv_shared = l - L->kv_source;
    b->ffn = lm_dense_ffn(&T->ffn, L->n_ff, LM_ACT_GELU_TANH);
    b->out_scale = L->out_scale;
    if (T->ffn.ffn_gate_inp.data == NULL) return;
    b->ffn_parallel = 1;
    b->post_dense_norm = L->post_ffn_norm_1;
    b->post_moe_norm = L->post_ffn_norm_2;
    b->moe = lm_softmax_experts(&T->ffn, c->n_expert, c->n_expert_used, L->n_ff_exp, 1.0f,
                                LM_ACT_GELU_TANH);
    b->moe.expert_scale = L->ffn_down_exps_scale;
    b->moe.norm = L->pre_ffn_norm_2;
    b->moe.router_norm = L->ffn_gate_inp_scale;
    b->moe.router_scale = 1.0f / sqrtf((float)c->n_embd);
    b->moe.norm_eps = c->rms_eps;
}

int gemma4_build(const gemma4_config *config, const lm_decoder_tensors *tensors,
                 const gemma4_weights *weights, int n_threads, int64_t n_batch, lm_base **out) {
    const gemma4_config *c = config;
    if (c == NULL || tensors == NULL || tensors->layers == NULL || weights == NULL ||
        weights->layers == NULL || out == NULL || c->n_layer <= 0 || c->n_embd_per_layer < 0 ||
        c->n_swa < 0 || n_batch <= 0 || n_batch > (1 << 20))
        return LM_EINVAL;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(c->n_layer, &m));
    m->rope = tensors->rope;
    m->rope_swa = tensors->rope_swa;
    for (int l = 0; l < c->n_layer; l++) g4_block(m, c, &tensors->layers[l], &weights->layers[l], l);
    m->dec.embd_scale = sqrtf((float)c->n_embd);
    m->dec.logit_softcap = c->logit_softcap;
    /* diffusion first: the hooks nest, so its canvas embedding comes before the per-layer
     * inputs are projected from the embeddings, and its pass's scalar after a layer's
     * per-layer input is added */
    int status = LM_OK;
    if (weights->sc_pre_norm != NULL) status = g4_diffusion_hook(m, c, weights);
    if (status == LM_OK && c->n_embd_per_layer > 0) status = g4_ple_hook(m, c, weights, n_batch);
    if (status != LM_OK) {
        lm_model_free(&m->base);
        return status;
    }
    return lm_decoder_end(m, &tensors->io, c->rms_eps, c->n_vocab, c->n_embd, n_threads, n_batch,
                          out);
}
