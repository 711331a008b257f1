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

/* The weights are the kit's lm_decoder_tensors (lmserve/types.h): every layer's attention
 * with per-head q and k norms and a post norm, and a GELU (tanh) gated MLP with a post norm;
 * swa layers are local (sliding-window) layers with rope_swa (NEOX, rope.freq_base_swa), the
 * others global with rope (NEOX, rope.freq_base and its scaling). Borrows the weights (the
 * mapped tensors and the rope frequencies must outlive the model; the layer array is read
 * during the call); *out is the model's lm_base, freed by lm_model_free. */
int gemma3_build(const gemma3_config *config, const lm_decoder_tensors *weights, int n_threads,
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

/* What is Gemma 4's own of a layer; the kit's lm_layer_tensors hold the rest (swa; the
 * attention: wqkv fused q, k, v or wq, wk, wv, with wv data NULL where V is K's projection,
 * wk unused when KV is shared; q_norm, k_norm, values RMS-normalised without a weight;
 * post_attn_norm; the dense GELU (tanh) MLP and its norms; the experts of MoE layers). */
typedef struct gemma4_layer {
    int kv_source;            /* the layer whose cache this one attends to: itself, or an
                                 earlier layer of the same kind (KV sharing: no K/V of its own) */
    int n_head;
    int n_kv_head;            /* of the cache attended to */
    int head_dim;             /* of queries, keys and values */
    int64_t n_ff;             /* dense feed-forward width */
    int64_t n_ff_exp;         /* one expert's width (MoE layers) */
    const float *post_ffn_norm_1; /* (n_embd) of the dense branch of a MoE layer, else NULL */
    const float *ffn_gate_inp_scale; /* (n_embd) multiplies rmsnorm(x) / sqrt(n_embd) */
    const float *pre_ffn_norm_2;  /* (n_embd) input norm of the experts */
    const float *ffn_down_exps_scale; /* (n_expert) multiplies each expert's output, or NULL */
    const float *post_ffn_norm_2; /* (n_embd) RMS norm of the experts' output */
    lm_matrix inp_gate;       /* (n_embd_per_layer, n_embd) PLE gate */
    lm_matrix proj;           /* (n_embd, n_embd_per_layer) PLE projection */
    const float *ple_post_norm;  /* (n_embd) RMS norm of the PLE projection */
    const float *out_scale;   /* (1) multiplies the layer's output (layer_output_scale), or NULL */
    const float *enc_out_scale; /* DiffusionGemma (1): multiplies the output of a causal pass
                                   (enc_layer_output_scale; out_scale then multiplies that of
                                   a bidirectional canvas pass), else NULL */
} gemma4_layer;

typedef struct gemma4_weights {
    const gemma4_layer *layers; /* (n_layer) */
    lm_matrix ple_token_embd;   /* (n_vocab, n_layer * n_embd_per_layer) per_layer_token_embd */
    lm_matrix ple_model_proj;   /* (n_layer * n_embd_per_layer, n_embd) per_layer_model_proj */
    const float *ple_proj_norm; /* (n_embd_per_layer) per_layer_proj_norm */
    /* DiffusionGemma's self-conditioning MLP (sc_pre_norm NULL: not a diffusion model) */
    const float *sc_pre_norm;   /* (n_embd) self_cond_pre_norm */
    lm_matrix sc_gate;          /* (sc_n_ff, n_embd) self_cond_gate */
    lm_matrix sc_up;            /* (sc_n_ff, n_embd) self_cond_up */
    lm_matrix sc_down;          /* (n_embd, sc_n_ff) self_cond_down */
    int64_t sc_n_ff;
} gemma4_weights;

/* tensors: the kit's lm_decoder_tensors (rope: global layers, NEOX, rope.freq_base and the
 * rope_freqs factors; rope_swa: local layers, NEOX, rope.freq_base_swa); weights: Gemma 4's
 * own. Borrows both (the mapped tensors and the rope frequencies must outlive the model; the
 * layer arrays are read during the call); *out is the model's lm_base, freed by
 * lm_model_free. */
int gemma4_build(const gemma4_config *config, const lm_decoder_tensors *tensors,
                 const gemma4_weights *weights, int n_threads, int64_t n_batch, lm_base **out);

/* DiffusionGemma (weights with sc_pre_norm): a causal pass (lm_forward) is the encoder's
 * (layer outputs times enc_out_scale); a bidirectional pass (lm_forward_bidirectional) is the
 * denoiser's over a canvas: its embeddings e (times sqrt(n_embd)) become
 * rmsnorm(e + sc_down . (gelu_tanh(sc_gate . s) * (sc_up . s))) without weight, where
 * s = rmsnorm(soft) * sc_pre_norm, and its layer outputs are times out_scale. `soft` (n rows
 * of n_embd, borrowed until the next call) are the soft embeddings of the previous step's
 * logits for the next bidirectional pass of n rows; NULL: none (the first step, whose
 * self-conditioning signal is 0). LM_EINVAL for a model without self-conditioning. */
int gemma4_self_condition(lm_base *b, const float *soft, int64_t n);

/* cdef-end */

#endif /* LMSERVE_GEMMA_FORWARD_H */
