/*
 * Forward passes of Gemma 3 and Gemma 4 (GGUF architectures gemma3, gemma4) over the lmserve
 * kit.
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

/* ------------------------------------------------------------------ Gemma 4 (gemma4)
 * Per-layer head counts and head widths (sliding and global layers differ), layers at the
 * end that attend to an earlier layer's cache (KV sharing), per-layer input embeddings
 * (PLE) and layers with a routed mixture of experts beside the dense feed-forward. */

typedef struct gemma4_config {
    int n_layer;
    int n_embd;
    int n_vocab;
    int n_embd_per_layer;  /* width of the per-layer inputs; 0: no PLE */
    int n_expert;          /* experts of the MoE layers; 0: none */
    int n_expert_used;     /* experts per token (top-k) */
    int64_t n_swa;         /* sliding window of the local layers (keys p - n_swa + 1 .. p) */
    float rms_eps;         /* of every RMS norm */
    float logit_softcap;   /* final_logit_softcapping; 0: none */
} gemma4_config;

typedef struct gemma4_layer {
    int swa;                  /* 1: a local (sliding-window) layer with rope_swa */
    int kv_source;            /* the layer whose cache this one attends to: itself, or an
                                 earlier layer of the same kind (KV sharing: no K/V of its own) */
    int n_head;
    int n_kv_head;            /* of the cache attended to */
    int head_dim;             /* of queries, keys and values */
    int64_t n_ff;             /* dense feed-forward width */
    int64_t n_ff_exp;         /* one expert's width (MoE layers) */
    const float *attn_norm;   /* (n_embd) */
    lm_matrix wqkv;           /* (n_head * head_dim + 2 * n_kv_head * head_dim, n_embd) fused
                                 q, k, v; data NULL: wq, wk, wv */
    lm_matrix wq;             /* (n_head * head_dim, n_embd) */
    lm_matrix wk;             /* (n_kv_head * head_dim, n_embd); unused when KV is shared */
    lm_matrix wv;             /* (n_kv_head * head_dim, n_embd); data NULL: V is K's projection */
    lm_matrix wo;             /* (n_embd, n_head * head_dim) */
    const float *q_norm;      /* (head_dim) RMS norm of every query head, before RoPE */
    const float *k_norm;      /* (head_dim) RMS norm of every key head, before RoPE; values are
                                 RMS-normalised without a weight */
    const float *post_attn_norm; /* (n_embd) RMS norm of the attention output */
    const float *ffn_norm;    /* (n_embd) */
    lm_matrix ffn_gate;       /* (n_ff, n_embd) GELU (tanh) gate */
    lm_matrix ffn_up;         /* (n_ff, n_embd) */
    lm_matrix ffn_down;       /* (n_embd, n_ff) */
    const float *post_ffn_norm_1; /* (n_embd) of the dense branch of a MoE layer, else NULL */
    lm_matrix ffn_gate_inp;   /* (n_expert, n_embd) router; data NULL: a dense layer */
    const float *ffn_gate_inp_scale; /* (n_embd) multiplies rmsnorm(x) / sqrt(n_embd) */
    const float *pre_ffn_norm_2;  /* (n_embd) input norm of the experts */
    lm_matrix ffn_gate_up_exps;   /* (n_expert, 2 * n_ff_exp, n_embd) gate rows then up rows;
                                     data NULL: ffn_gate_exps and ffn_up_exps */
    lm_matrix ffn_gate_exps;  /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix ffn_up_exps;    /* (n_expert, n_ff_exp, n_embd) */
    lm_matrix ffn_down_exps;  /* (n_expert, n_embd, n_ff_exp) */
    const float *ffn_down_exps_scale; /* (n_expert) multiplies each expert's output, or NULL */
    const float *post_ffn_norm_2; /* (n_embd) RMS norm of the experts' output */
    const float *post_ffn_norm;   /* (n_embd) RMS norm of the feed-forward output */
    lm_matrix inp_gate;       /* (n_embd_per_layer, n_embd) PLE gate */
    lm_matrix proj;           /* (n_embd, n_embd_per_layer) PLE projection */
    const float *ple_post_norm;  /* (n_embd) RMS norm of the PLE projection */
    const float *out_scale;   /* (1) multiplies the layer's output (layer_output_scale), or NULL */
} gemma4_layer;

typedef struct gemma4_weights {
    lm_matrix token_embd;       /* (n_vocab, n_embd) */
    const gemma4_layer *layers; /* (n_layer) */
    const float *output_norm;   /* (n_embd) */
    lm_matrix output;           /* (n_vocab, n_embd); token_embd when tied */
    lm_matrix ple_token_embd;   /* (n_vocab, n_layer * n_embd_per_layer) per_layer_token_embd */
    lm_matrix ple_model_proj;   /* (n_layer * n_embd_per_layer, n_embd) per_layer_model_proj */
    const float *ple_proj_norm; /* (n_embd_per_layer) per_layer_proj_norm */
    lm_rotary rope;             /* global layers: NEOX, rope.freq_base, rope_freqs factors */
    lm_rotary rope_swa;         /* local layers: NEOX, rope.freq_base_swa */
} gemma4_weights;

/* Borrows the weights (the mapped tensors and the rope frequencies must outlive the model;
 * the layer array is read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int gemma4_build(const gemma4_config *config, const gemma4_weights *weights, int n_threads,
                 int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_GEMMA_FORWARD_H */
