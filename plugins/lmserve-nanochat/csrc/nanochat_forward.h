/*
 * Forward pass of nanochat's GPT (karpathy/nanochat, every generation of nanochat/gpt.py and
 * the Hugging Face port) over the lmserve kit.
 *
 *   x = rmsnorm(wte[tok]); smear: x_t += smear_lambda sigmoid(smear_gate . x_t[:24]) x_{t-1}
 *   x0 = x; per layer i:  x = resid_lambdas[i] x + x0_lambdas[i] x0
 *                         x += attn(rmsnorm(x)); x += c_proj . relu(c_fc . rmsnorm(x))^2
 *   backout: x -= backout_lambda (x after layer backout_layer); logits of rmsnorm(x), softcap
 * Every norm is weightless. The blocks are the kit's (the value embeddings its value residual,
 * the MLP its ungated RELU2 one); the embedding's norm, the smear, the lambdas and the
 * backout are the decoder's hooks.
 *
 * Numerics: activations stay f32 and every product accumulates in f32 against the weights
 * (f32, f16, bf16 or q8_0), so the result is the float32 forward of those weights.
 *
 * The region between the cdef markers is also the cffi declaration of this module: plain C
 * declarations only (no preprocessor lines). lm_* types come from lmserve/types.h.
 */
#ifndef LMSERVE_NANOCHAT_FORWARD_H
#define LMSERVE_NANOCHAT_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct nanochat_config {
    lm_dims dims;             /* n_ff: the MLP's width; rms_eps: of every norm */
    const int64_t *windows;   /* (n_layer) keys a query sees, its own included; 0: all */
    float logit_softcap;      /* 0: none */
    int backout_layer;        /* the layer whose output is subtracted at the end; -1: none */
    int smear_cols;           /* channels the smear gate reads (24); 0: no smear */
    int ve_gate_cols;         /* channels the value-embedding gates read */
    float ve_gate_scale;      /* gate = scale * sigmoid(ve_gate . x[:cols]) */
} nanochat_config;

/* What is nanochat's own of a layer (the kit's lm_layer_tensors hold the rest). */
typedef struct nanochat_layer {
    lm_matrix value_embd;     /* (n_vocab, n_kv_head * head_dim); data NULL: none */
    const float *ve_gate;     /* (n_kv_head, ve_gate_cols) f32, with value_embd */
} nanochat_layer;

typedef struct nanochat_weights {
    const nanochat_layer *layers; /* (n_layer) */
    const float *resid_lambdas;   /* (n_layer), or NULL with x0_lambdas: 1 and 0 */
    const float *x0_lambdas;      /* (n_layer) */
    const float *smear_gate;      /* (smear_cols), with smear_cols > 0 */
    const float *smear_lambda;    /* (1) */
    const float *backout_lambda;  /* (1), with backout_layer >= 0 */
} nanochat_weights;

/* tensors: the kit's lm_decoder_tensors: attention without input norm, q_norm and k_norm
 * both qk_scale (the weightless per-head norm, then the 1.2 of the smear generation), rope
 * NEOX over the whole head (the rows of the second half of every q and k head negated:
 * nanochat turns by -theta); the MLP's ffn_up (c_fc) and ffn_down (c_proj), no gate, no
 * norms; output_norm NULL. Borrows both tables' tensors (the layer arrays and windows are
 * read during the call); *out is the model's lm_base, freed by lm_model_free. */
int nanochat_build(const nanochat_config *config, const lm_decoder_tensors *tensors,
                   const nanochat_weights *weights, int n_threads, int64_t n_batch,
                   lm_base **out);

/* The smear reads the embedding of the token before a chunk's first row, which the chunk
 * does not hold: before each forward call, the caller names for every cache the call runs
 * the position it continues at and the token at the position before it (-1 at position 0).
 * A chunk of a sequence at pos > 0 whose cache was not named at pos fails with LM_EINVAL;
 * the model advances the entry itself from chunk to chunk of a long prompt. */
int nanochat_previous(lm_base *model, int n, lm_cache *const *caches, const int64_t *pos,
                      const int32_t *tokens);

/* cdef-end */

#endif /* LMSERVE_NANOCHAT_FORWARD_H */
