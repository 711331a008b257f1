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

/* The weights are the kit's lm_decoder_tensors (lmserve/types.h): every layer's attention
 * with per-head q and k norms, and a SiLU-gated MLP (qwen3) or a router and n_expert SiLU
 * experts (qwen3moe); rope: NEOX pairs (i, i + head_dim / 2). Borrows the weights (the
 * mapped tensors and the rope frequencies must outlive the model; the layer array is read
 * during the call); *out is the model's lm_base, freed by lm_model_free. */
int qwen3_build(const qwen3_config *config, const lm_decoder_tensors *weights, int n_threads,
                int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_QWEN3_FORWARD_H */
