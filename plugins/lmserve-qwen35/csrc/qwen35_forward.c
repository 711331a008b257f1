/*
 * Forward pass of Qwen3.5, Qwen3.5-MoE and Qwen3-Next over the lmserve kit.
 *
 * Per layer:  h = rmsnorm(x) * attn_norm
 *             x += deltanet(h)                                      recurrent layers
 *             x += wo . (attention(rope(qnorm(q)), rope(knorm(k)), v) * sigmoid(gate))
 *                                                                   the others
 *             h = rmsnorm(x) * post_attention_norm
 *             x += mlp(h)                 qwen35: SiLU-gated
 *                                         moe: top-k of a softmax router, renormalised,
 *                                         + sigmoid(shexp_gate . h) * shared_expert(h)
 * The kit's decoder block runs every kind of layer: this file maps the weight table onto it.
 */
#include "qwen35_forward.h"

#include <math.h>

static void qwen35_mlp(lm_block *b, const qwen35_config *c, const qwen35_layer *L) {
    LM_SILU_MLP(b, L, c->dims.n_ff, c->n_expert, c->n_expert_used, c->expert_weights_scale);
    if (c->n_expert > 0 && c->n_ff_shexp > 0) {
        b->shexp = (lm_ffn){L->ffn_gate_shexp, L->ffn_up_shexp, L->ffn_down_shexp, c->n_ff_shexp,
                            LM_ACT_SILU};
        b->shexp_gate = L->ffn_gate_inp_shexp;
    }
}

int qwen35_build(const qwen35_config *config, const qwen35_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out) {
    const qwen35_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL ||
        c->n_expert < 0 || (c->n_expert > 0 && c->n_expert_used <= 0) || c->n_ff_shexp < 0)
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(d->n_layer, &m));
    m->rope = weights->rope;
    const float scale = 1.0f / sqrtf((float)d->head_dim);
    for (int l = 0; l < d->n_layer; l++) {
        const qwen35_layer *L = &weights->layers[l];
        lm_block *b = &m->blocks[l];
        b->norm_eps = d->rms_eps;
        b->attn_norm = L->attn_norm;
        b->ffn_norm = L->ffn_norm;
        if (L->recurrent) {
            b->mixer = LM_MIXER_DELTANET;
            b->delta = (lm_deltanet){
                .wqkv = L->wqkv, .wz = L->wgate, .wa = L->walpha, .wb = L->wbeta,
                .wba = L->wba, .wo = L->ssm_out, .conv = L->ssm_conv, .a = L->ssm_a,
                .dt_bias = L->ssm_dt, .norm = L->ssm_norm, .n_k_head = c->ssm_n_k_head,
                .n_v_head = c->ssm_n_v_head, .head_k = c->ssm_head_k, .head_v = c->ssm_head_v,
                .conv_kernel = c->ssm_conv_kernel, .head_map = c->ssm_head_map,
                .norm_eps = d->rms_eps,
            };
        } else {
            b->mixer = LM_MIXER_ATTENTION;
            b->attn = (lm_attn){
                .wq = L->wq, .wk = L->wk, .wv = L->wv, .wo = L->wo,
                .q_norm = L->q_norm, .k_norm = L->k_norm, .norm_eps = d->rms_eps,
                .n_head = d->n_head, .n_kv_head = d->n_kv_head, .head_dim = d->head_dim,
                .scale = scale, .rope = &m->rope, .gated = 1,
            };
        }
        qwen35_mlp(b, c, L);
    }
    m->dec.token_embd = weights->token_embd;
    m->dec.output_norm = weights->output_norm;
    m->dec.output = weights->output;
    m->dec.norm_eps = d->rms_eps;
    return lm_decoder_finish(m, n_threads, n_batch, d->n_vocab, d->n_embd, out);
}
