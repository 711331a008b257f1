/*
 * Forward pass of Qwen3 and Qwen3-MoE over the lmserve kit.
 *
 * Per layer:  h = rmsnorm(x)
 *             q, k = rmsnorm_per_head(wq . h), rmsnorm_per_head(wk . h)
 *             x += wo . attention(rope_neox(q), rope_neox(k), wv . h)
 *             x += mlp(rmsnorm(x))        qwen3: SiLU-gated
 *                                         qwen3moe: softmax router over every expert, the
 *                                         top n_expert_used renormalised to sum to 1
 * The kit's pre-norm decoder block runs it: this file maps the weight table onto blocks.
 */
#include "qwen3_forward.h"

#include <math.h>

/* The feed-forward half of a layer: dense, or a router over experts. */
static void qwen3_mlp(lm_block *b, const qwen3_config *c, const qwen3_layer *L) {
    LM_SILU_MLP(b, L, c->dims.n_ff, c->n_expert, c->n_expert_used, c->expert_weights_scale);
}

int qwen3_build(const qwen3_config *config, const qwen3_weights *weights, int n_threads,
                int64_t n_batch, lm_base **out) {
    const qwen3_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL ||
        c->n_expert < 0 || (c->n_expert > 0 && c->n_expert_used <= 0))
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(d->n_layer, &m));
    m->rope = weights->rope;
    const float scale = 1.0f / sqrtf((float)d->head_dim);
    for (int l = 0; l < d->n_layer; l++) {
        const qwen3_layer *L = &weights->layers[l];
        lm_block *b = &m->blocks[l];
        b->norm_eps = d->rms_eps;
        b->attn_norm = L->attn_norm;
        b->attn = (lm_attn){
            .wq = L->wq, .wk = L->wk, .wv = L->wv, .wo = L->wo,
            .q_norm = L->q_norm, .k_norm = L->k_norm, .norm_eps = d->rms_eps,
            .n_head = d->n_head, .n_kv_head = d->n_kv_head, .head_dim = d->head_dim,
            .scale = scale, .rope = &m->rope,
        };
        b->ffn_norm = L->ffn_norm;
        qwen3_mlp(b, c, L);
    }
    m->dec.token_embd = weights->token_embd;
    m->dec.output_norm = weights->output_norm;
    m->dec.output = weights->output;
    m->dec.norm_eps = d->rms_eps;
    return lm_decoder_finish(m, n_threads, n_batch, d->n_vocab, d->n_embd, out);
}
