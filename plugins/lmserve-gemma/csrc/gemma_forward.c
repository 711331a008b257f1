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

int gemma3_build(const gemma3_config *config, const gemma3_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out) {
    const gemma3_config *c = config;
    if (c == NULL || weights == NULL || weights->layers == NULL || out == NULL || c->n_swa < 0 ||
        !(c->attn_scale > 0.0f) || !(c->logit_softcap >= 0.0f))
        return LM_EINVAL;
    const lm_dims *d = &c->dims;
    lm_decoder_model *m;
    LM_TRY(lm_decoder_new(d->n_layer, &m));
    m->rope = weights->rope;
    m->rope_swa = weights->rope_swa;
    for (int l = 0; l < d->n_layer; l++) {
        const gemma3_layer *L = &weights->layers[l];
        const int local = L->swa && c->n_swa > 0;
        lm_block *b = &m->blocks[l];
        b->norm_eps = d->rms_eps;
        b->attn_norm = L->attn_norm;
        b->attn = (lm_attn){
            .wq = L->wq, .wk = L->wk, .wv = L->wv, .wo = L->wo,
            .q_norm = L->q_norm, .k_norm = L->k_norm, .norm_eps = d->rms_eps,
            .n_head = d->n_head, .n_kv_head = d->n_kv_head, .head_dim = d->head_dim,
            .scale = c->attn_scale, .rope = local ? &m->rope_swa : &m->rope,
            .window = local ? c->n_swa : 0,
        };
        b->post_attn_norm = L->post_attn_norm;
        b->ffn_norm = L->ffn_norm;
        b->ffn = (lm_ffn){L->ffn_gate, L->ffn_up, L->ffn_down, d->n_ff, LM_ACT_GELU_TANH};
        b->post_ffn_norm = L->post_ffn_norm;
    }
    m->dec.token_embd = weights->token_embd;
    m->dec.output_norm = weights->output_norm;
    m->dec.output = weights->output;
    m->dec.norm_eps = d->rms_eps;
    m->dec.embd_scale = sqrtf((float)d->n_embd);
    m->dec.logit_softcap = c->logit_softcap;
    return lm_decoder_finish(m, n_threads, n_batch, d->n_vocab, d->n_embd, out);
}
