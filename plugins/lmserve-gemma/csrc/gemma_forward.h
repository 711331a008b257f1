/*
 * Forward pass of Gemma 3 (GGUF architecture gemma3) over the lmserve kit.
 *
 * Numerics: activations stay f32 and every product accumulates in f32 against weights
 * decoded block by block from the mapped GGUF, so the result is the float32 forward of the
 * dequantized model.
 *
 * The region between the cdef markers is also the cffi declaration of this module: plain C
 * declarations only (no preprocessor lines). lm_* types come from lmserve/types.h.
 */
#ifndef LMSERVE_GEMMA_FORWARD_H
#define LMSERVE_GEMMA_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct gemma3_config {
    lm_dims dims;          /* head_dim is attention.key_length */
    int64_t n_swa;         /* sliding window of the local layers (keys p - n_swa + 1 .. p) */
    float attn_scale;      /* multiplies the queries: 1 / sqrt(head_dim), or the 27B's */
    float logit_softcap;   /* final_logit_softcapping; 0: none */
} gemma3_config;

typedef struct gemma3_layer {
    int swa;                  /* 1: a local (sliding-window) layer with rope_swa */
    const float *attn_norm;   /* (n_embd) */
    lm_matrix wq;             /* (n_head * head_dim, n_embd) */
    lm_matrix wk;             /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wv;             /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wo;             /* (n_embd, n_head * head_dim) */
    const float *q_norm;      /* (head_dim) RMS norm of every query head, before RoPE */
    const float *k_norm;      /* (head_dim) RMS norm of every key head, before RoPE */
    const float *post_attn_norm; /* (n_embd) RMS norm of the attention output */
    const float *ffn_norm;    /* (n_embd) */
    lm_matrix ffn_gate;       /* (n_ff, n_embd) GELU (tanh) gate */
    lm_matrix ffn_up;         /* (n_ff, n_embd) */
    lm_matrix ffn_down;       /* (n_embd, n_ff) */
    const float *post_ffn_norm; /* (n_embd) RMS norm of the feed-forward output */
} gemma3_layer;

typedef struct gemma3_weights {
    lm_matrix token_embd;       /* (n_vocab, n_embd) */
    const gemma3_layer *layers; /* (n_layer) */
    const float *output_norm;   /* (n_embd) */
    lm_matrix output;           /* (n_vocab, n_embd); token_embd when tied */
    lm_rotary rope;             /* global layers: NEOX, rope.freq_base and its scaling */
    lm_rotary rope_swa;         /* local layers: NEOX, rope.freq_base_swa */
} gemma3_weights;

/* Borrows the weights (the mapped tensors and the rope frequencies must outlive the model;
 * the layer array is read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int gemma3_build(const gemma3_config *config, const gemma3_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_GEMMA_FORWARD_H */
