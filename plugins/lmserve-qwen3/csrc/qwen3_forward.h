/*
 * Forward pass of Qwen3 (GGUF architecture qwen3) and Qwen3-MoE (qwen3moe) over the lmserve
 * kit.
 *
 * Numerics: activations stay f32 and every product accumulates in f32 against weights
 * decoded block by block from the mapped GGUF, so the result is the float32 forward of the
 * dequantized model.
 *
 * The region between the cdef markers is also the cffi declaration of this module: plain C
 * declarations only (no preprocessor lines). lm_* types come from lmserve/types.h.
 */
#ifndef LMSERVE_QWEN3_FORWARD_H
#define LMSERVE_QWEN3_FORWARD_H

#include "lmserve/kit.h"

/* cdef-begin */

typedef struct qwen3_config {
    lm_dims dims;       /* head_dim is attention.key_length, not n_embd / n_head; n_ff is
                           one expert's width in qwen3moe */
    int n_expert;       /* qwen3moe: experts per layer; 0 for qwen3 */
    int n_expert_used;  /* experts each token goes through (top-k) */
    float expert_weights_scale; /* multiplies the renormalised expert weights */
} qwen3_config;

typedef struct qwen3_layer {
    const float *attn_norm;  /* (n_embd) */
    lm_matrix wq;            /* (n_head * head_dim, n_embd) */
    lm_matrix wk;            /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wv;            /* (n_kv_head * head_dim, n_embd) */
    lm_matrix wo;            /* (n_embd, n_head * head_dim) */
    const float *q_norm;     /* (head_dim) RMS norm of every query head, before RoPE */
    const float *k_norm;     /* (head_dim) RMS norm of every key head, before RoPE */
    const float *ffn_norm;   /* (n_embd) */
    /* qwen3: a SiLU-gated MLP */
    lm_matrix ffn_gate;      /* (n_ff, n_embd) */
    lm_matrix ffn_up;        /* (n_ff, n_embd) */
    lm_matrix ffn_down;      /* (n_embd, n_ff) */
    /* qwen3moe: a router and n_expert SiLU-gated MLPs */
    lm_matrix ffn_gate_inp;  /* (n_expert, n_embd) router */
    lm_matrix ffn_gate_exps; /* (n_expert, n_ff, n_embd) */
    lm_matrix ffn_up_exps;   /* (n_expert, n_ff, n_embd) */
    lm_matrix ffn_gate_up_exps; /* (n_expert, 2 n_ff, n_embd); data NULL: the two above */
    lm_matrix ffn_down_exps; /* (n_expert, n_embd, n_ff) */
} qwen3_layer;

typedef struct qwen3_weights {
    lm_matrix token_embd;      /* (n_vocab, n_embd) */
    const qwen3_layer *layers; /* (n_layer) */
    const float *output_norm;  /* (n_embd) */
    lm_matrix output;          /* (n_vocab, n_embd); token_embd when tied */
    lm_rotary rope;            /* NEOX pairs (i, i + head_dim / 2) */
} qwen3_weights;

/* Borrows the weights (the mapped tensors and the rope frequencies must outlive the model;
 * the layer array is read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int qwen3_build(const qwen3_config *config, const qwen3_weights *weights, int n_threads,
                int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_QWEN3_FORWARD_H */
