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

int qwen3_build(const qwen3_config *config, const lm_decoder_tensors *weights, int n_threads,
                int64_t n_batch, lm_base **out) {
    const qwen3_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL ||
        c->n_expert < 0 || (c->n_expert > 0 && c->n_expert_used <= 0))
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_begin(d, weights, 1.0f / sqrtf((float)d->head_dim), 0, &m));
    for (int l = 0; l < d->n_layer; l++)
        lm_block_silu_ffn(&m->blocks[l], &weights->layers[l].ffn, d->n_ff, c->n_expert,
                          c->n_expert_used, c->expert_weights_scale, 0);
    return lm_decoder_end(m, &weights->io, d->rms_eps, d->n_vocab, d->n_embd, n_threads, n_batch,
                          out);
}
