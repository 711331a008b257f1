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

/* The weights are the kit's lm_decoder_tensors (lmserve/types.h): every layer's attention
 * (attn_norm, wq, wk, wv, wo) and SiLU-gated MLP (ffn_norm, ffn_gate, ffn_up, ffn_down);
 * rope: NORMAL pairs, the converter permuted q and k for them. Borrows the weights (the
 * mapped tensors and the rope frequencies must outlive the model; the layer array is read
 * during the call); *out is the model's lm_base, freed by lm_model_free. */
int llama_build(const lm_dims *dims, const lm_decoder_tensors *weights, int n_threads,
                int64_t n_batch, lm_base **out);

/* cdef-end */

#endif /* LMSERVE_LLAMA_FORWARD_H */
