/*
 * Forward pass of Gemma 3 over the lmserve kit.
 *
 *   x = embed(tokens) * sqrt(n_embd)
 *   per layer:  h = rmsnorm(x)
 *               q, k = rmsnorm_per_head(wq . h), rmsnorm_per_head(wk . h)
 *               x += rmsnorm(wo . attention(rope_neox(q) * attn_scale, rope_neox(k), wv . h))
 *               x += rmsnorm(down . (gelu_tanh(gate . h') * up . h')),  h' = rmsnorm(x)
 *   logits = softcap(output . rmsnorm(x))
 * Local layers attend over a sliding window with their own RoPE base; their cache is a ring
 * of the window and one chunk. The kit's pre-norm decoder block runs all of it (the
 * "sandwich" norms are its post norms): this file maps the weight table onto blocks.
 */
#include "gemma_forward.h"

#include <math.h>

int gemma3_build(const gemma3_config *config, const lm_decoder_tensors *weights, int n_threads,
                 int64_t n_batch, lm_base **out) {
    const gemma3_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL || c->n_swa < 0 ||
        !(c->attn_scale > 0.0f) || !(c->logit_softcap >= 0.0f))
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_begin(d, weights, c->attn_scale, c->n_swa, &m));
    for (int l = 0; l < d->n_layer; l++)
        m->blocks[l].ffn = lm_dense_ffn(&weights->layers[l].ffn, d->n_ff, LM_ACT_GELU_TANH);
    m->dec.embd_scale = sqrtf((float)d->n_embd);
    m->dec.logit_softcap = c->logit_softcap;
    return lm_decoder_end(m, &weights->io, d->rms_eps, d->n_vocab, d->n_embd, n_threads, n_batch,
                          out);
}
