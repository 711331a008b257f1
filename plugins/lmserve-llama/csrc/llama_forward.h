/*
 * Forward pass of the llama architecture (Llama 2/3, SmolLM2, Mistral-style GGUFs) over the
 * shared lmserve kernels.
 *
 * Numerics: activations stay f32 and every product accumulates in f32 against weights
 * decoded block by block from the mapped GGUF, so the result is the float32 forward of the
 * dequantized model.
 *
 * The region between the cdef markers is also the cffi declaration of this module: it holds
 * plain C declarations only (no preprocessor lines).
 */
#ifndef LMSERVE_LLAMA_FORWARD_H
#define LMSERVE_LLAMA_FORWARD_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* cdef-begin */

/* Status codes: the shared kernels' codes (LM_*) pass through; these add to them. */
enum llama_status {
    LLAMA_OK = 0,
    LLAMA_EINVAL = -1,  /* bad argument: NULL, size out of range, position past n_ctx */
    LLAMA_ENOMEM = -2,
    LLAMA_ETYPE = -3,   /* a weight type the kernels do not support */
    LLAMA_EMISMATCH = -10 /* caches of different geometry */
};

typedef struct llama_config {
    int n_layer;
    int n_embd;          /* model width */
    int n_ff;            /* feed-forward width */
    int n_head;
    int n_kv_head;
    int head_dim;        /* n_embd / n_head for every llama GGUF */
    int n_rot;           /* rotated dims per head (rope.dimension_count) */
    int n_vocab;
    int n_batch;         /* most tokens pushed through one weight pass */
    float rms_eps;
    float rope_freq_base;
    float rope_freq_scale;
} llama_config;

/* A weight matrix as mapped from the GGUF: rows x cols of `type` (a GGML type id). */
typedef struct llama_matrix {
    const void *data;
    int type;
} llama_matrix;

typedef struct llama_layer {
    const float *attn_norm;   /* (n_embd) */
    llama_matrix wq;          /* (n_head * head_dim, n_embd) */
    llama_matrix wk;          /* (n_kv_head * head_dim, n_embd) */
    llama_matrix wv;          /* (n_kv_head * head_dim, n_embd) */
    llama_matrix wo;          /* (n_embd, n_head * head_dim) */
    const float *ffn_norm;    /* (n_embd) */
    llama_matrix w_gate;      /* (n_ff, n_embd) */
    llama_matrix w_up;        /* (n_ff, n_embd) */
    llama_matrix w_down;      /* (n_embd, n_ff) */
} llama_layer;

typedef struct llama_weights {
    llama_matrix token_embd;  /* (n_vocab, n_embd) */
    const llama_layer *layers; /* (n_layer) */
    const float *output_norm; /* (n_embd) */
    llama_matrix output;      /* (n_vocab, n_embd); token_embd when tied */
} llama_weights;

typedef struct llama_model llama_model;
typedef struct llama_cache llama_cache;

/* The model borrows the weights (the layer array and the mapped data must outlive it) and
 * owns a thread pool of n_threads (<= 0: one per core) and scratch for n_batch tokens. */
int llama_model_build(const llama_config *config, const llama_weights *weights,
                      int n_threads, llama_model **out);
void llama_model_free(llama_model *model);
int llama_model_threads(const llama_model *model);

/* A KV cache of n_ctx positions: per layer, f32 K and V of n_ctx x (n_kv_head * head_dim).
 * Zeroed pages are mapped lazily, so memory follows the rows actually written. */
int llama_cache_build(const llama_model *model, int64_t n_ctx, llama_cache **out);
void llama_cache_free(llama_cache *cache);
int64_t llama_cache_n_ctx(const llama_cache *cache);
/* Rows [0, n) of every layer's K and V from src into dst (same geometry, n <= both n_ctx). */
int llama_cache_copy_rows(const llama_cache *src, llama_cache *dst, int64_t n);

/* Run tokens[0..ntok) at positions pos..pos+ntok-1, writing their K/V rows into the cache.
 * logits: n_vocab floats for the last token, or ntok x n_vocab with all_logits.
 * Token ids must lie in [0, n_vocab) and pos + ntok <= the cache's n_ctx. */
int llama_forward(llama_model *model, llama_cache *cache, const int32_t *tokens,
                  int64_t ntok, int64_t pos, float *logits, int all_logits);

/* cdef-end */

#ifdef __cplusplus
}
#endif
#endif /* LMSERVE_LLAMA_FORWARD_H */
