/*
 * Forward pass of the llama architecture over the lmserve kit.
 *
 * Per layer:  x += attention(rmsnorm(x))         (rope on q and k, grouped-query heads)
 *             x += ffn_down . (silu(ffn_gate . rmsnorm(x)) * (ffn_up . rmsnorm(x)))
 * which is the kit's pre-norm decoder block: this file maps the llama weight table onto it.
 */
#include "llama_forward.h"

#include <math.h>

int llama_build(const lm_dims *dims, const lm_decoder_tensors *weights, int n_threads,
                int64_t n_batch, lm_base **out) {
    const lm_dims *d = dims;
    if (d == NULL || weights == NULL || weights->layers == NULL || out == NULL) return LM_EINVAL;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_begin(d, weights, 1.0f / sqrtf((float)d->head_dim), 0, &m));
    for (int l = 0; l < d->n_layer; l++)
        m->blocks[l].ffn = lm_dense_ffn(&weights->layers[l].ffn, d->n_ff, LM_ACT_SILU);
    return lm_decoder_end(m, &weights->io, d->rms_eps, d->n_vocab, d->n_embd, n_threads, n_batch,
                          out);
}
