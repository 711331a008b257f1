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

int qwen35_build(const qwen35_config *config, const lm_decoder_tensors *weights,
                 const qwen35_deltanet *delta, int n_threads, int64_t n_batch, lm_base **out) {
    const qwen35_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || delta == NULL || out == NULL ||
        c->n_expert < 0 || (c->n_expert > 0 && c->n_expert_used <= 0) || c->n_ff_shexp < 0)
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_begin(d, weights, 1.0f / sqrtf((float)d->head_dim), 0, &m));
    for (int l = 0; l < d->n_layer; l++) {
        const qwen35_deltanet *L = &delta[l];
        lm_block *b = &m->blocks[l];
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
            b->attn = (lm_attn){0};
        } else {
            b->attn.gated = 1;
        }
        lm_block_silu_ffn(b, &weights->layers[l].ffn, d->n_ff, c->n_expert, c->n_expert_used,
                          c->expert_weights_scale, c->n_ff_shexp);
    }
    return lm_decoder_end(m, &weights->io, d->rms_eps, d->n_vocab, d->n_embd, n_threads, n_batch,
                          out);
}
