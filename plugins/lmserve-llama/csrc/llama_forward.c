/*
 * Forward pass of the llama architecture over the lmserve kit.
 *
 * Per layer:  x += attention(rmsnorm(x))         (rope on q and k, grouped-query heads)
 *             x += ffn_down . (silu(ffn_gate . rmsnorm(x)) * (ffn_up . rmsnorm(x)))
 * which is the kit's pre-norm decoder block: this file maps the llama weight table onto it.
 */
#include "llama_forward.h"

#include <math.h>

int llama_build(const lm_dims *dims, const llama_weights *weights, int n_threads,
                int64_t n_batch, lm_base **out) {
    const lm_dims *c = dims;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL) return LM_EINVAL;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(c->n_layer, &m));
    m->rope = weights->rope;
    for (int l = 0; l < c->n_layer; l++) {
        const llama_layer *L = &weights->layers[l];
        m->blocks[l] = (lm_block){
            .norm_eps = c->rms_eps,
            .attn_norm = L->attn_norm,
            .attn = {.wq = L->wq, .wk = L->wk, .wv = L->wv, .wo = L->wo,
                     .n_head = c->n_head, .n_kv_head = c->n_kv_head, .head_dim = c->head_dim,
                     .scale = 1.0f / sqrtf((float)c->head_dim), .rope = &m->rope},
            .ffn_norm = L->ffn_norm,
            .ffn = {L->ffn_gate, L->ffn_up, L->ffn_down, c->n_ff, LM_ACT_SILU},
        };
    }
    m->dec = (lm_decoder){weights->token_embd, m->blocks, weights->output_norm, weights->output,
                          c->rms_eps};
    return lm_decoder_finish(m, n_threads, n_batch, c->n_vocab, c->n_embd, out);
}
