/*
 * Forward pass of the llama architecture (Llama 2/3, SmolLM2, Mistral-style GGUFs) over the
 * lmserve kit.
 *
 * Numerics: activations stay f32 and every product accumulates in f32 against weights
 * decoded block by block from the mapped GGUF, so the result is the float32 forward of the
 * dequantized model.
 *
 * The region between the cdef markers is also the cffi declaration of this module: plain C
 * declarations only (no preprocessor lines). lm_* types come from lmserve/types.h.
 */
#ifndef LMSERVE_LLAMA_FORWARD_H
#define LMSERVE_LLAMA_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct llama_layer {
    const float *attn_norm;   /* (n_embd) */
    lm_matrix wq;             /* (n_head * head_dim, n_embd) */
    lm_matrix wk;             /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wv;             /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wo;             /* (n_embd, n_head * head_dim) */
    const float *ffn_norm;    /* (n_embd) */
    lm_matrix ffn_gate;       /* (n_ff, n_embd) */
    lm_matrix ffn_up;         /* (n_ff, n_embd) */
    lm_matrix ffn_down;       /* (n_embd, n_ff) */
} llama_layer;

typedef struct llama_weights {
    lm_matrix token_embd;      /* (n_vocab, n_embd) */
    const llama_layer *layers; /* (n_layer) */
    const float *output_norm;  /* (n_embd) */
    lm_matrix output;          /* (n_vocab, n_embd); token_embd when tied */
    lm_rotary rope;            /* NORMAL pairs: the converter permuted q and k for them */
} llama_weights;

/* Borrows the weights (the mapped tensors and the rope frequencies must outlive the model;
 * the layer array is read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int llama_build(const lm_dims *dims, const llama_weights *weights, int n_threads,
                int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_LLAMA_FORWARD_H */
